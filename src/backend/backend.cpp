#include "backend/backend.h"

#include <algorithm>
#include <charconv>
#include <system_error>
#include <vector>

#include "backend/cpu/cpu_ops.h"
#if defined(RECUR_HAVE_CUDA)
#include "backend/cuda/cuda_ops.h"
#endif

namespace recur {

namespace {

constexpr int kMaxDeviceIndex = 1 << 16;  // far beyond any host; keeps N + rank in range

// The device indices of "cuda", "cuda:N" or "cuda:N,M,...".
Result<std::vector<int>> cuda_indices(const std::string& device) {
  std::vector<int> out;
  if (device == "cuda") return std::vector<int>{0};
  const char* p = device.data() + 5;
  const char* end = device.data() + device.size();
  for (;;) {
    int index = -1;
    const auto [next, ec] = std::from_chars(p, end, index);
    if (ec != std::errc() || index < 0 || index > kMaxDeviceIndex || next == p) {
      return make_error(ErrorCode::kInvalidArgument,
                        "device '{}': expected cuda:N or cuda:N,M,... (device indices)", device);
    }
    out.push_back(index);
    if (next == end) return out;
    if (*next != ',' || out.size() >= 64) {
      return make_error(ErrorCode::kInvalidArgument,
                        "device '{}': expected cuda:N or cuda:N,M,... (device indices)", device);
    }
    p = next + 1;
  }
}

}  // namespace

Result<std::unique_ptr<Ops>> create_backend(const std::string& device, int threads, int rank,
                                            int world, const BackendOptions& options) {
  if (device == "cpu") {
    const int n = threads > 0 ? threads : default_thread_count();
    try {
      return std::unique_ptr<Ops>(new CpuOps(n));
    } catch (const std::system_error& e) {
      return make_error(ErrorCode::kOutOfResources, "cannot start {} CPU threads: {}", n, e.what());
    }
  }
  if (device == "cuda" || device.rfind("cuda:", 0) == 0) {
    RECUR_ASSIGN_OR_RETURN(const std::vector<int> indices, cuda_indices(device));
    if (indices.size() > 1 && int(indices.size()) != world) {
      return make_error(ErrorCode::kInvalidArgument,
                        "device {} names {} devices for {} tensor-parallel ranks", device,
                        indices.size(), world);
    }
    if (rank < 0 || rank >= std::max(world, 1)) {
      return make_error(ErrorCode::kInvalidArgument, "tensor-parallel rank {} of {}", rank, world);
    }
    const int index = indices.size() > 1 ? indices[size_t(rank)] : indices[0] + rank;
#if defined(RECUR_HAVE_CUDA)
    RECUR_ASSIGN_OR_RETURN(auto cuda, CudaOps::create(index, options));
    return std::unique_ptr<Ops>(std::move(cuda));
#else
    (void)index, (void)options;
    return make_error(ErrorCode::kUnsupported,
                      "device {}: this build has no CUDA backend (configure with -DRECUR_CUDA=ON)",
                      device);
#endif
  }
  return make_error(ErrorCode::kInvalidArgument,
                    "device '{}': expected cpu, cuda, cuda:N or cuda:N,M,...", device);
}

}  // namespace recur
