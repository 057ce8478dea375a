// placeholder while the op is written
#include "kernels/cuda/sampling.h"
