"""A real etcd for tests: ``with Etcd(tmp_path) as etcd: etcd.url`` (Debian's ``etcd-server``);
the same private etcd ``aps launch --replica-count`` starts (:mod:`aps.lab.etcd`)."""

from __future__ import annotations

from ..lab.etcd import Etcd, etcd_available

__all__ = ["Etcd", "etcd_available"]
