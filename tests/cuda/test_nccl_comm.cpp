// The NCCL communicator: one rank alone on device 0 (the identity, and the process's NVLink
// multicast turned off), and two ranks on two devices (skipped on a machine with one GPU):
// sums and gathered columns against the values computed here.
#if defined(RECUR_HAVE_NCCL)
#include <cuda_runtime.h>
#include <gtest/gtest.h>

#include <cstdlib>
#include <string>
#include <thread>
#include <vector>

#include "backend/cuda/cuda_ops.h"
#include "backend/cuda/nccl_comm.h"

namespace recur {
namespace {

#define CUDA_OK(expr) ASSERT_EQ((expr), cudaSuccess) << #expr

float value(int rank, int64_t i) {
  return float((rank + 1) * 1000) + float(i % 97) * 0.5f;
}

// On `device` as `rank` of `world`: all_reduce_sum of [rows, cols] and all_gather_cols of
// [rows, c] into a strided out; the results read back into *sums and *gathered.
void run_rank(const NcclId& id, int rank, int world, int device, std::vector<float>* sums,
              std::vector<float>* gathered) {
  constexpr int64_t kRows = 3, kCols = 129, kPart = 5, kOutStride = 64;
  CUDA_OK(cudaSetDevice(device));
  cudaStream_t stream = nullptr;
  CUDA_OK(cudaStreamCreate(&stream));
  auto ops = CudaOps::create(device);  // for its allocator, which the gather scratch comes from
  ASSERT_TRUE(ops.ok()) << ops.error().to_string();
  auto comm = NcclCommunicator::create(
      id, rank, world, device, [stream]() -> void* { return stream; }, (*ops)->allocator());
  ASSERT_TRUE(comm.ok()) << comm.error().to_string();
  const int64_t live = (*ops)->allocator().stats().live_buffers;
  ASSERT_TRUE((*comm)->reserve_gather(kRows * kPart).ok());
  EXPECT_EQ((*ops)->allocator().stats().live_buffers, live + 1);  // counted as the rank's
  const char* nvls = std::getenv("NCCL_NVLS_ENABLE");
  EXPECT_TRUE(nvls && std::string(nvls) == "0");
  std::vector<float> x(kRows * kCols), part(kRows * kPart);
  for (int64_t i = 0; i < int64_t(x.size()); ++i) x[size_t(i)] = value(rank, i);
  for (int64_t i = 0; i < int64_t(part.size()); ++i) part[size_t(i)] = value(rank, i + 7);
  float *dx = nullptr, *dpart = nullptr, *dout = nullptr;
  CUDA_OK(cudaMalloc(&dx, x.size() * 4));
  CUDA_OK(cudaMalloc(&dpart, part.size() * 4));
  CUDA_OK(cudaMalloc(&dout, size_t(kRows * kOutStride) * 4));
  CUDA_OK(cudaMemcpy(dx, x.data(), x.size() * 4, cudaMemcpyHostToDevice));
  CUDA_OK(cudaMemcpy(dpart, part.data(), part.size() * 4, cudaMemcpyHostToDevice));
  CUDA_OK(cudaMemset(dout, 0xFF, size_t(kRows * kOutStride) * 4));  // NaN where unwritten
  (*comm)->all_reduce_sum(Tensor::contiguous(dx, DType::F32, {kRows, kCols}, Device::kCuda));
  Tensor out = Tensor::contiguous(dout, DType::F32, {kRows, kOutStride}, Device::kCuda)
                   .slice_cols(0, kPart * world);
  (*comm)->all_gather_cols(Tensor::contiguous(dpart, DType::F32, {kRows, kPart}, Device::kCuda),
                           out);
  CUDA_OK(cudaStreamSynchronize(stream));
  sums->resize(x.size());
  gathered->resize(size_t(kRows * kPart * world));
  CUDA_OK(cudaMemcpy(sums->data(), dx, x.size() * 4, cudaMemcpyDeviceToHost));
  CUDA_OK(cudaMemcpy2D(gathered->data(), size_t(kPart * world) * 4, dout, size_t(kOutStride) * 4,
                       size_t(kPart * world) * 4, size_t(kRows), cudaMemcpyDeviceToHost));
  comm->reset();
  cudaFree(dx), cudaFree(dpart), cudaFree(dout);
  cudaStreamDestroy(stream);
}

void expect_results(int world, const std::vector<float>& sums, const std::vector<float>& gathered) {
  constexpr int64_t kRows = 3, kPart = 5;
  for (int64_t i = 0; i < int64_t(sums.size()); ++i) {
    float want = 0;
    for (int r = 0; r < world; ++r) want += value(r, i);
    ASSERT_EQ(sums[size_t(i)], want) << "element " << i;
  }
  for (int64_t row = 0; row < kRows; ++row) {
    for (int r = 0; r < world; ++r) {
      for (int64_t j = 0; j < kPart; ++j) {
        ASSERT_EQ(gathered[size_t((row * world + r) * kPart + j)], value(r, row * kPart + j + 7))
            << "row " << row << " rank " << r << " column " << j;
      }
    }
  }
}

TEST(NcclCommunicator, OneRankIsTheIdentity) {
  auto id = make_nccl_id();
  ASSERT_TRUE(id.ok()) << id.error().to_string();
  std::vector<float> sums, gathered;
  run_rank(*id, 0, 1, 0, &sums, &gathered);
  expect_results(1, sums, gathered);
}

TEST(NcclCommunicator, TwoRanksOnTwoDevices) {
  int devices = 0;
  CUDA_OK(cudaGetDeviceCount(&devices));
  if (devices < 2) GTEST_SKIP() << "one GPU: two NCCL ranks need two";
  auto id = make_nccl_id();
  ASSERT_TRUE(id.ok()) << id.error().to_string();
  std::vector<float> sums[2], gathered[2];
  std::thread other([&] { run_rank(*id, 1, 2, 1, &sums[1], &gathered[1]); });
  run_rank(*id, 0, 2, 0, &sums[0], &gathered[0]);
  other.join();
  for (int r = 0; r < 2; ++r) expect_results(2, sums[r], gathered[r]);
}

}  // namespace
}  // namespace recur
#endif  // RECUR_HAVE_NCCL
