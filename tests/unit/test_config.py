import argparse
import dataclasses

import pytest

from aps.cli._args import add_server_arguments, config_from_args
from aps.config import ServerConfig, env_name
from aps.errors import ConfigurationError


def parse(argv, environ=None):
    parser = argparse.ArgumentParser()
    add_server_arguments(parser)
    return config_from_args(parser.parse_args(argv), environ or {})


def test_defaults():
    config = parse([])
    assert config == ServerConfig()
    assert config.sync == "bsp" and config.host == "127.0.0.1" and config.staleness is None


def test_flags():
    config = parse(
        ["--workers", "4", "--sync", "ssp", "--staleness", "5", "--optimizer", "sgd", "--betas", "0.8,0.99",
         "--nesterov", "--momentum", "0.9", "--max-frame-bytes", "16M", "--port", "0"]
    )
    assert (config.workers, config.sync, config.staleness, config.optimizer) == (4, "ssp", 5, "sgd")
    assert config.betas == (0.8, 0.99) and config.nesterov and config.max_frame_bytes == 16 << 20


@pytest.mark.parametrize(
    "options, bounds, text",
    [
        ({"sync": "bsp"}, None, "bsp"),
        ({"sync": "asp", "lr_staleness": "inverse"}, None, "asp lr/staleness"),
        ({"sync": "ssp"}, (3, 3), "ssp s=3"),
        ({"sync": "dssp"}, (3, 15), "dssp s_L=3 s_U=15"),
        ({"sync": "dssp", "staleness": 20}, (20, 20), "dssp s_L=20 s_U=20"),
        ({"sync": "dssp", "staleness": 2, "max_staleness": 6}, (2, 6), "dssp s_L=2 s_U=6"),
        ({"sync": "softsync", "workers": 4, "softsync_n": 2}, None, "softsync n=2"),
        ({"sync": "softsync", "staleness": 1}, (1, 1), "softsync n=1 s=1"),
    ],
)
def test_staleness_bounds(options, bounds, text):
    config = ServerConfig(**options)
    assert config.staleness_bounds() == bounds
    assert config.describe_sync() == text


# option: (raw value, parsed value, other variables it needs to make sense)
EXAMPLES = {
    "host": ("0.0.0.0", "0.0.0.0", {"APS_INSECURE": "1"}),
    "port": ("0", 0, {}),
    "workers": ("3", 3, {}),
    "min_workers": ("2", 2, {"APS_WORKERS": "4"}),
    "quorum_timeout": ("30", 30.0, {}),
    "shard": ("1", 1, {"APS_SHARDS": "2"}),
    "shards": ("2", 2, {}),
    "sync": ("asp", "asp", {}),
    "staleness": ("7", 7, {"APS_SYNC": "ssp"}),
    "max_staleness": ("9", 9, {"APS_SYNC": "dssp"}),
    "staleness_cutoff": ("4", 4, {"APS_SYNC": "asp"}),
    "compensation": ("dc-adaptive:2", "dc-adaptive:2", {"APS_SYNC": "asp"}),
    "softsync_n": ("2", 2, {"APS_SYNC": "softsync", "APS_WORKERS": "4"}),
    "backup_workers": ("1", 1, {"APS_WORKERS": "3"}),
    "lr_staleness": ("inverse", "inverse", {}),
    "async_scale": ("mean", "mean", {}),
    "optimizer": ("adamw", "adamw", {}),
    "lr": ("0.5", 0.5, {}),
    "momentum": ("0.9", 0.9, {}),
    "nesterov": ("1", True, {"APS_MOMENTUM": "0.9"}),
    "momentum_period": ("4", 4, {"APS_OPTIMIZER": "delayed-nesterov", "APS_MOMENTUM": "0.9"}),
    "momentum_activation": (
        "0.25", 0.25, {"APS_OPTIMIZER": "delayed-nesterov", "APS_MOMENTUM": "0.9", "APS_WORKERS": "4"}
    ),
    "weight_decay": ("0.001", 0.001, {}),
    "betas": ("0.5,0.6", (0.5, 0.6), {}),
    "eps": ("1e-6", 1e-6, {}),
    "unix_socket": ("none", "none", {}),
    "heartbeat_timeout": ("2.5", 2.5, {}),
    "max_frame_bytes": ("1G", 1 << 30, {}),
    "stream_min_bytes": ("0", 0, {}),
    "table_memory": ("64M", 64 << 20, {}),
    "kernel_threads": ("2", 2, {}),
    "kernel_isa": ("avx2", "avx2", {}),
    "max_connections": ("64", 64, {}),
    "token": ("Zq3u9P0vB4h1xkTn7sWc2yLr8GdJ5mEaQiFo6XtKbHw", "Zq3u9P0vB4h1xkTn7sWc2yLr8GdJ5mEaQiFo6XtKbHw", {}),
    "token_file": ("/etc/aps/token", "/etc/aps/token", {}),
    "insecure": ("1", True, {}),
    "tls_cert": ("/etc/aps/cert.pem", "/etc/aps/cert.pem", {}),
    "tls_key": ("/etc/aps/key.pem", "/etc/aps/key.pem", {"APS_TLS_CERT": "/etc/aps/cert.pem"}),
    "tls_ca": ("/etc/aps/ca.pem", "/etc/aps/ca.pem", {"APS_TLS_CERT": "/etc/aps/cert.pem"}),
    "handshake_timeout": ("2.5", 2.5, {}),
    "http_port": ("9090", 9090, {}),
    "checkpoint_dir": ("/var/aps", "/var/aps", {}),
    "checkpoint_every": ("2.5", 2.5, {}),
    "checkpoint_every_updates": ("100", 100, {}),
    "checkpoint_keep": ("5", 5, {}),
    "resume": ("/var/aps/checkpoint-00000001-v10", "/var/aps/checkpoint-00000001-v10", {}),
    "fork_run": ("1", True, {"APS_RESUME": "/var/aps/checkpoint-00000001-v10"}),
    "resume_unsigned": ("1", True, {"APS_RESUME": "/var/aps/checkpoint-00000001-v10"}),
    "replicas": ("10.0.0.1:7070,10.0.0.2:7070", "10.0.0.1:7070,10.0.0.2:7070",
                 {"APS_PORT": "7070", "APS_ADVERTISE": "10.0.0.1:7070", "APS_COORDINATOR": "etcd://10.0.0.9:2379",
                  "APS_TOKEN": "Zq3vN8wLk2pR7sT1yU5xC9bM4dF6gH0j"}),
    "advertise": ("10.0.0.1:7070", "10.0.0.1:7070", {}),
    "coordinator": ("etcd://10.0.0.9:2379", "etcd://10.0.0.9:2379", {}),
    "replica_set": ("run-7-shard-0", "run-7-shard-0", {}),
    "failover_timeout": ("0.25", 0.25, {}),
    "replica_timeout": ("5", 5.0, {}),
    "log_level": ("debug", "debug", {}),
}


def test_every_option_has_an_environment_twin():
    fields = {f.name for f in dataclasses.fields(ServerConfig)}
    assert fields == set(EXAMPLES), "add an example for each new option"
    for name, (raw, value, context) in EXAMPLES.items():
        config = parse([], {env_name(name): raw, **context})
        assert getattr(config, name) == value, name


def test_flag_beats_environment():
    assert parse(["--workers", "2"], {"APS_WORKERS": "5"}).workers == 2


@pytest.mark.parametrize(
    "environ",
    [{"APS_WORKERS": "many"}, {"APS_SYNC": "gossip"}, {"APS_NESTEROV": "maybe"}, {"APS_BETAS": "0.9"}, {"APS_WORKERS": "0"}],
)
def test_bad_environment_values(environ):
    with pytest.raises(ConfigurationError, match="APS_|workers"):
        parse([], environ)


@pytest.mark.parametrize(
    "options",
    [{"workers": 0}, {"staleness": -1, "sync": "ssp"}, {"backup_workers": 2, "workers": 2},
     {"backup_workers": 1, "workers": 3, "sync": "asp"}, {"port": 70000}, {"sync": "nope"}, {"max_frame_bytes": 10},
     {"staleness": 2, "sync": "asp"}, {"max_staleness": 5, "sync": "ssp"}, {"sync": "dssp", "staleness": 5, "max_staleness": 4},
     {"softsync_n": 2, "sync": "asp", "workers": 2}, {"softsync_n": 3, "sync": "softsync", "workers": 2},
     {"lr_staleness": "half"}, {"async_scale": "median"}],
)
def test_validation(options):
    with pytest.raises(ConfigurationError):
        ServerConfig(**options)


@pytest.mark.parametrize("option, value", [("lr", float("inf")), ("lr", float("nan")), ("momentum", float("nan")),
                                           ("heartbeat_timeout", float("nan")), ("checkpoint_every", float("inf"))])
def test_options_that_are_not_numbers_are_refused(option, value):
    with pytest.raises(ConfigurationError, match=f"--{option.replace('_', '-')} must be a finite number"):
        ServerConfig(**{option: value})


@pytest.mark.parametrize("given", [["--workers", "2:6"], ["--min-workers", "2", "--workers", "6"]])
def test_workers_min_max_is_elastic(given):
    config = parse(given, {})
    assert (config.min_workers, config.workers, config.quorum, config.elastic) == (2, 6, 2, True)
    assert config.describe_workers() == "2:6"
    assert parse([], {"APS_WORKERS": "2:6"}).min_workers == 2
    assert ServerConfig(workers="3:5").quorum == 3
    fixed = parse(["--workers", "4"], {})
    assert (fixed.min_workers, fixed.quorum, fixed.elastic, fixed.describe_workers()) == (None, 4, False, "4")
    assert not ServerConfig(workers="4:4").elastic  # MIN == MAX is a fixed size


@pytest.mark.parametrize("workers", ["6:2", "0:4", "a:b", "2:", "2:70000"])
def test_bad_workers_ranges_are_refused(workers):
    with pytest.raises(ConfigurationError, match="workers"):
        ServerConfig(workers=workers)


def test_an_elastic_run_bounds_backups_and_softsync_by_min():
    ServerConfig(workers="2:8", sync="softsync", softsync_n=2)
    with pytest.raises(ConfigurationError, match="MIN"):
        ServerConfig(workers="2:8", sync="softsync", softsync_n=3)
    with pytest.raises(ConfigurationError, match="backup"):
        ServerConfig(workers="2:8", backup_workers=2)


@pytest.mark.parametrize("options, message", [
    ({"lr": -1.0}, "--lr must be >= 0"),
    ({"momentum": -0.5}, "--momentum must be >= 0"),
    ({"weight_decay": -1e-4}, "--weight-decay must be >= 0"),
    ({"optimizer": "adam", "eps": -1e-8}, "--eps must be >= 0"),
    ({"optimizer": "adam", "betas": (1.0, 0.999)}, "beta1 must be in \\[0, 1\\)"),
    ({"optimizer": "adamw", "betas": (0.9, -0.1)}, "beta2 must be in \\[0, 1\\)"),
    ({"optimizer": "adam", "betas": (0.9, float("nan"))}, "beta2 must be in \\[0, 1\\)"),
    ({"nesterov": True}, "--nesterov needs a --momentum > 0"),
    ({"optimizer": "adam", "momentum": 0.9}, "apply to --optimizer sgd, not adam"),
    ({"optimizer": "adamw", "nesterov": True, "momentum": 0.9}, "apply to --optimizer sgd, not adamw"),
])
def test_optimizer_values_outside_torchs_ranges_are_refused(options, message):
    """What torch.optim's SGD, Adam and AdamW refuse, refused when the options are made."""
    with pytest.raises(ConfigurationError, match=message):
        ServerConfig(**options)


def test_the_ranges_hold_for_flags_and_environment_twins_alike():
    with pytest.raises(ConfigurationError, match="--lr must be >= 0"):
        parse(["--lr", "-1"])
    with pytest.raises(ConfigurationError, match="--lr must be >= 0"):
        parse([], {"APS_LR": "-0.1"})
    with pytest.raises(ConfigurationError, match="beta1 must be in"):
        parse(["--optimizer", "adam", "--betas", "1.5,0.9"])
    # the edges torch accepts
    assert parse(["--lr", "0", "--momentum", "0", "--weight-decay", "0"]).lr == 0.0
    assert parse(["--optimizer", "adam", "--betas", "0,0", "--eps", "0"]).betas == (0.0, 0.0)
