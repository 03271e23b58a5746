"""Developer tools, not benchmarks: ahead-of-time builds of the kernels for sm_90a on a machine
without a GPU (`aot_sm90.py`: the Gluon kernel, `aot_triton_sm90.py`: the Triton kernels), and
readers of Nsight Compute reports (`ncu_pc_stalls.py`, `ncu_top_stalls.py`)."""
