#include "kernels/cuda/gemm.h"
