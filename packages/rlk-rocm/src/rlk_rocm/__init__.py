"""rlk_rocm: backend "rocm" = the rlk-triton kernels with AMD CDNA tuning tables."""
