# cython: language_level=3, boundscheck=False, wraparound=False, cdivision=True
# cython: initializedcheck=False, nonecheck=False, embedsignature=True
#
# The native core of aps: fused update kernels, the staleness window, and the
# embedding tables' index and row kernels.
# One extension module, split with include files; aps/_reference.py is its
# plain-Python twin and the oracle for its tests.

include "_optim.pxi"
include "_window.pxi"
include "_rows.pxi"
