// The NCCL communicator: a group made from one thread of one rank alone on device 0 (the
// identity, and the process's NVLink multicast turned off) and of two ranks on two devices
// (skipped on a machine with one GPU), each rank then on its own thread: sums and gathered
// columns against the values computed here, the gather scratch counted by the rank's allocator.
#if defined(RECUR_HAVE_NCCL)
#include <cuda_runtime.h>
#include <gtest/gtest.h>

#include <cstdlib>
#include <memory>
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

// Rank `comm.rank()` on `device`, with collectives on `stream`: all_reduce_sum of
// [rows, cols] and all_gather_cols of [rows, c] into a strided out; the results read back into
// *sums and *gathered.
void run_rank(Communicator& comm, int device, cudaStream_t stream, std::vector<float>* sums,
              std::vector<float>* gathered) {
  constexpr int64_t kRows = 3, kCols = 129, kPart = 5, kOutStride = 64;
  const int rank = comm.rank(), world = comm.world();
  CUDA_OK(cudaSetDevice(device));
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
  comm.all_reduce_sum(Tensor::contiguous(dx, DType::F32, {kRows, kCols}, Device::kCuda));
  Tensor out = Tensor::contiguous(dout, DType::F32, {kRows, kOutStride}, Device::kCuda)
                   .slice_cols(0, kPart * world);
  comm.all_gather_cols(Tensor::contiguous(dpart, DType::F32, {kRows, kPart}, Device::kCuda), out);
  CUDA_OK(cudaStreamSynchronize(stream));
  sums->resize(x.size());
  gathered->resize(size_t(kRows * kPart * world));
  CUDA_OK(cudaMemcpy(sums->data(), dx, x.size() * 4, cudaMemcpyDeviceToHost));
  CUDA_OK(cudaMemcpy2D(gathered->data(), size_t(kPart * world) * 4, dout, size_t(kOutStride) * 4,
                       size_t(kPart * world) * 4, size_t(kRows), cudaMemcpyDeviceToHost));
  cudaFree(dx), cudaFree(dpart), cudaFree(dout);
}

// A group of one rank per device in `devices`, made from this thread; each rank then runs on
// a thread of its own (rank 0 on this one); every rank's results checked.
void run_group(const std::vector<int>& devices) {
  constexpr int64_t kRows = 3, kPart = 5;
  const int world = int(devices.size());
  std::vector<std::unique_ptr<CudaOps>> ops;  // for their allocators and streams
  std::vector<NcclCommunicator::RankPlace> places;
  for (int d : devices) {
    auto o = CudaOps::create(d);
    ASSERT_TRUE(o.ok()) << o.error().to_string();
    ops.push_back(std::move(*o));
    CudaOps* p = ops.back().get();
    places.push_back({d, [p] { return p->current_stream(); }, &p->allocator()});
  }
  auto comms = NcclCommunicator::create_group(places);
  ASSERT_TRUE(comms.ok()) << comms.error().to_string();
  const char* nvls = std::getenv("NCCL_NVLS_ENABLE");
  EXPECT_TRUE(nvls && std::string(nvls) == "0");
  for (int r = 0; r < world; ++r) {
    const int64_t live = ops[size_t(r)]->allocator().stats().live_buffers;
    ASSERT_TRUE((*comms)[size_t(r)]->reserve_gather(kRows * kPart).ok());
    EXPECT_EQ(ops[size_t(r)]->allocator().stats().live_buffers, live + 1);  // the rank's
  }
  std::vector<std::vector<float>> sums(static_cast<size_t>(world)),
      gathered(static_cast<size_t>(world));
  auto run = [&](int r) {
    run_rank(*(*comms)[size_t(r)], devices[size_t(r)],
             static_cast<cudaStream_t>(ops[size_t(r)]->current_stream()), &sums[size_t(r)],
             &gathered[size_t(r)]);
  };
  std::vector<std::thread> others;
  for (int r = 1; r < world; ++r) others.emplace_back(run, r);
  run(0);
  for (std::thread& t : others) t.join();
  for (int r = 0; r < world; ++r) expect_results(world, sums[size_t(r)], gathered[size_t(r)]);
  comms->clear();  // before the backends whose memory they hold
}

TEST(NcclCommunicator, OneRankIsTheIdentity) {
  run_group({0});
}

TEST(NcclCommunicator, TwoRanksOnTwoDevices) {
  int devices = 0;
  CUDA_OK(cudaGetDeviceCount(&devices));
  if (devices < 2) GTEST_SKIP() << "one GPU: two NCCL ranks need two";
  run_group({0, 1});
}

}  // namespace
}  // namespace recur
#endif  // RECUR_HAVE_NCCL
