"""mtdeepep's GPU kernels in Triton (one source for NVIDIA, AMD and Moore Threads GPUs; the interpreter runs them on
CPU tensors). `low_latency`: DeepEP's low-latency dispatch and combine."""
