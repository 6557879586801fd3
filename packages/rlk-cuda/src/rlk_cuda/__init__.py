"""rlk_cuda: backend "cuda" = the rlk-triton kernels with NVIDIA (SM80/SM90) tuning tables."""
