// The device probe of a build without CUDA: the actor runs the CPU backend.
#include "actors/cuda_probe.h"

namespace tessera {

CudaProbe probe_cuda() {
  CudaProbe p;
  p.note = "this Tessera build has no CUDA backend (configured with TESSERA_CUDA=OFF or no nvcc)";
  return p;
}

}  // namespace tessera
