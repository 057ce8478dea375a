// placeholder while the op is written
#include "kernels/cuda/attention.h"
