#include "backend/backend.h"

#include "backend/cpu/cpu_ops.h"
#if defined(RECUR_HAVE_CUDA)
#include "backend/cuda/cuda_ops.h"
#endif

namespace recur {

bool cuda_available() {
#if defined(RECUR_HAVE_CUDA)
  return true;
#else
  return false;
#endif
}

Result<std::unique_ptr<Ops>> create_backend(const std::string& device, int threads) {
  if (device == "cpu") {
    return std::unique_ptr<Ops>(new CpuOps(threads > 0 ? threads : default_thread_count()));
  }
  if (device == "cuda" || device.rfind("cuda:", 0) == 0) {
#if defined(RECUR_HAVE_CUDA)
    int index = 0;
    if (device.size() > 5) {
      try {
        index = std::stoi(device.substr(5));
      } catch (const std::exception&) {
        return make_error(ErrorCode::kInvalidArgument, "--device '{}': bad device index", device);
      }
    }
    RECUR_ASSIGN_OR_RETURN(auto cuda, CudaOps::create(index));
    return std::unique_ptr<Ops>(std::move(cuda));
#else
    return make_error(ErrorCode::kUnsupported,
                      "--device {}: this build has no CUDA backend (configure with -DRECUR_CUDA=ON)",
                      device);
#endif
  }
  return make_error(ErrorCode::kInvalidArgument, "--device '{}': expected cpu, cuda or cuda:N",
                    device);
}

}  // namespace recur
