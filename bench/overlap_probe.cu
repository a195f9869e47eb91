// Can the layer's memory-bound passes run beside its compute-bound products (issue 19)?
//
// The layer's backward runs the down projection's d lhs product and then the activation's
// backward over its output, one after the other: at the Mixtral benchmark shape (M 65536 rows,
// K = H 1024, N = F 4096) about 790 us of tensor-core work, then about 807 us of bytes (3.2 GB
// at copy bandwidth). Fusing the two in one kernel's epilogue measured slower (bench/NOTES.md:
// three helper warps cannot keep up). Another way: the product in row chunks on S of the SMs,
// and each chunk's activation, as soon as its rows are out, on the others, on a second stream.
// This program measures whether that pays, with cuBLAS's GEMM standing in for the library's
// product (cublasSetSmCountTarget limits it to S SMs) and the library's own activation_bwd:
//
//   - each alone on every SM: the GEMM [M, K] x [K, N] -> grad_hidden [M, N] in bf16, and
//     SwiGLU's activation_bwd over grad_hidden and the pre-activation [M, 2N];
//   - in C row chunks one after the other on one stream (what the layer does, C = 1);
//   - in C row chunks, the GEMMs on a high-priority stream limited to S SMs, each chunk's
//     activation on a low-priority stream after an event on its GEMM.
//
// Prints the median of each one's timings (cudaEvents around the whole, both streams joined),
// repeated for at least half a second so that the clock settles where the power limit holds it,
// and the SM clock and board power NVML reads at the end of the repeats. On a Hopper GPU:
//
//   nvcc -O3 -arch=sm_90a -std=c++17 --expt-relaxed-constexpr -o overlap_probe bench/overlap_probe.cu -lcublas -ldl
//   ./overlap_probe [M=65536] [K=1024] [N=4096]
#include <cublas_v2.h>
#include <cuda_runtime.h>
#include <dlfcn.h>

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <functional>
#include <vector>

#include "check.cuh"
#include "../kernels/activation.cu"  // the library's activation_bwd (a template), as the layer runs it

// The SM clock (MHz) and board power (W) of device 0 now, from the driver's NVML (opened at
// run time: no NVML header or library to build against); -1 where it is missing.
struct Nvml {
  using Init = int (*)();
  using Handle = int (*)(unsigned, void**);
  using Clock = int (*)(void*, int, unsigned*);
  using Power = int (*)(void*, unsigned*);
  void* device = nullptr;
  Clock clock = nullptr;
  Power power = nullptr;

  Nvml() {
    void* library = dlopen("libnvidia-ml.so.1", RTLD_NOW);
    if (library == nullptr) return;
    const auto init = reinterpret_cast<Init>(dlsym(library, "nvmlInit_v2"));
    const auto handle = reinterpret_cast<Handle>(dlsym(library, "nvmlDeviceGetHandleByIndex_v2"));
    clock = reinterpret_cast<Clock>(dlsym(library, "nvmlDeviceGetClockInfo"));
    power = reinterpret_cast<Power>(dlsym(library, "nvmlDeviceGetPowerUsage"));
    if (init == nullptr || handle == nullptr || init() != 0 || handle(0, &device) != 0) device = nullptr;
  }
  int sm_mhz() const {
    unsigned mhz = 0;
    return device != nullptr && clock != nullptr && clock(device, 1 /* NVML_CLOCK_SM */, &mhz) == 0 ? int(mhz) : -1;
  }
  int watts() const {
    unsigned milliwatts = 0;
    return device != nullptr && power != nullptr && power(device, &milliwatts) == 0 ? int(milliwatts / 1000) : -1;
  }
};

// Finite bf16 values of moderate size from a hash of the index.
__global__ void fill(bf16* x, size_t count, unsigned seed) {
  for (size_t i = blockIdx.x * size_t(blockDim.x) + threadIdx.x; i < count; i += size_t(gridDim.x) * blockDim.x) {
    unsigned h = unsigned(i) * 2654435761u ^ seed;
    h ^= h >> 15;
    h *= 2246822519u;
    h ^= h >> 13;
    x[i] = from_float<bf16>((float(h & 0xffff) / 65536.f - 0.5f) * 0.25f);
  }
}

__global__ void fill_probs(float* p, int rows) {
  for (int i = blockIdx.x * blockDim.x + threadIdx.x; i < rows; i += gridDim.x * blockDim.x) p[i] = 0.5f;
}

int main(int argc, char** argv) {
  const int m = argc > 1 ? std::atoi(argv[1]) : 65536, k = argc > 2 ? std::atoi(argv[2]) : 1024,
            n = argc > 3 ? std::atoi(argv[3]) : 4096;
  int sms = 0;
  CHECK(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, 0));
  bf16 *a, *b, *grad_hidden, *pre, *grad_pre, *weighted;
  float *probs, *grad_probs;
  CHECK(cudaMalloc(&a, size_t(m) * k * 2));
  CHECK(cudaMalloc(&b, size_t(k) * n * 2));
  CHECK(cudaMalloc(&grad_hidden, size_t(m) * n * 2));
  CHECK(cudaMalloc(&pre, size_t(m) * 2 * n * 2));
  CHECK(cudaMalloc(&grad_pre, size_t(m) * 2 * n * 2));
  CHECK(cudaMalloc(&weighted, size_t(m) * n * 2));
  CHECK(cudaMalloc(&probs, size_t(m) * 4));
  CHECK(cudaMalloc(&grad_probs, size_t(m) * 4));
  fill<<<1024, 256>>>(a, size_t(m) * k, 1);
  fill<<<1024, 256>>>(b, size_t(k) * n, 2);
  fill<<<1024, 256>>>(pre, size_t(m) * 2 * n, 3);
  fill_probs<<<256, 256>>>(probs, m);
  CHECK(cudaDeviceSynchronize());

  int least_priority = 0, greatest_priority = 0;
  CHECK(cudaDeviceGetStreamPriorityRange(&least_priority, &greatest_priority));
  cudaStream_t product_stream, activation_stream;
  CHECK(cudaStreamCreateWithPriority(&product_stream, cudaStreamNonBlocking, greatest_priority));
  CHECK(cudaStreamCreateWithPriority(&activation_stream, cudaStreamNonBlocking, least_priority));
  cublasHandle_t handle;
  CHECK(cublasCreate(&handle));
  CHECK(cublasSetStream(handle, product_stream));
  const std::vector<int> chunk_counts = {1, 2, 4, 8};
  std::vector<cudaEvent_t> chunk_done(chunk_counts.back());
  for (auto& e : chunk_done) CHECK(cudaEventCreateWithFlags(&e, cudaEventDisableTiming));
  cudaEvent_t start, stop, joined;
  CHECK(cudaEventCreate(&start));
  CHECK(cudaEventCreate(&stop));
  CHECK(cudaEventCreateWithFlags(&joined, cudaEventDisableTiming));

  // grad_hidden rows [row0, row0 + rows) = a's rows times b (row-major: column-major b x a).
  auto product = [&](int row0, int rows) {
    const float one = 1.f, zero = 0.f;
    CHECK(cublasGemmEx(handle, CUBLAS_OP_N, CUBLAS_OP_N, n, rows, k, &one, b, CUDA_R_16BF, n,
                       a + size_t(row0) * k, CUDA_R_16BF, k, &zero, grad_hidden + size_t(row0) * n, CUDA_R_16BF, n,
                       CUBLAS_COMPUTE_32F, CUBLAS_GEMM_DEFAULT));
  };
  auto activation = [&](int row0, int rows, cudaStream_t stream) {
    activation_bwd<bf16, SWIGLU, 16, ACTIVATION_THREADS><<<(rows + 7) / 8, ACTIVATION_THREADS, 0, stream>>>(
        grad_hidden + size_t(row0) * n, pre + size_t(row0) * 2 * n, probs + row0, nullptr, 0, rows, n,
        grad_pre + size_t(row0) * 2 * n, weighted + size_t(row0) * n, grad_probs + row0);
  };
  // The median of `work`'s timings (after 3 untimed), in us, repeated for at least 0.5 s, with the
  // SM clock and board power at the end.
  struct Timing {
    float us;
    int mhz, watts;
  };
  const Nvml nvml;
  auto time = [&](const std::function<void()>& work) {
    std::vector<float> us;
    float total_ms = 0.f;
    for (int i = 0; i < 3 || total_ms < 500.f; ++i) {
      CHECK(cudaEventRecord(start, product_stream));
      work();
      CHECK(cudaEventRecord(stop, product_stream));
      CHECK(cudaEventSynchronize(stop));
      float ms = 0.f;
      CHECK(cudaEventElapsedTime(&ms, start, stop));
      if (i >= 3) us.push_back(ms * 1000.f), total_ms += ms;
    }
    std::nth_element(us.begin(), us.begin() + us.size() / 2, us.end());
    return Timing{us[us.size() / 2], nvml.sm_mhz(), nvml.watts()};
  };
  auto print = [](const char* what, const Timing& t) {
    std::printf("%s %.0f (%d MHz, %d W)", what, t.us, t.mhz, t.watts);
  };
  auto sequential = [&](int chunks) {
    return time([&] {
      for (int c = 0; c < chunks; ++c) {
        product(c * (m / chunks), m / chunks);
        activation(c * (m / chunks), m / chunks, product_stream);
      }
    });
  };
  auto overlapped = [&](int chunks) {
    return time([&] {
      // The activation stream starts after `start` and the product stream ends after it.
      CHECK(cudaEventRecord(joined, product_stream));
      CHECK(cudaStreamWaitEvent(activation_stream, joined));
      for (int c = 0; c < chunks; ++c) {
        product(c * (m / chunks), m / chunks);
        CHECK(cudaEventRecord(chunk_done[c], product_stream));
        CHECK(cudaStreamWaitEvent(activation_stream, chunk_done[c]));
        activation(c * (m / chunks), m / chunks, activation_stream);
      }
      CHECK(cudaEventRecord(joined, activation_stream));
      CHECK(cudaStreamWaitEvent(product_stream, joined));
    });
  };

  std::printf("M %d, K %d, N %d (bf16; SwiGLU's backward over [M, %d]), %d SMs; us, medians over 0.5 s\n", m, k, n,
              2 * n, sms);
  CHECK(cublasSetSmCountTarget(handle, 0));
  const Timing gemm = time([&] { product(0, m); });
  print("GEMM alone", gemm);
  const Timing act = time([&] { activation(0, m, product_stream); });
  const double flops = 2.0 * m * k * n, bytes = 6.0 * m * n * 2 + 8.0 * m;
  print("; activation_bwd alone", act);
  std::printf("; sum %.0f (%.0f TFLOP/s, %.0f GB/s)\n", gemm.us + act.us, flops / gemm.us / 1e6, bytes / act.us / 1e3);
  for (int target : {sms - 16, sms - 32, sms - 48}) {
    CHECK(cublasSetSmCountTarget(handle, target));
    std::printf("GEMM alone on %d SMs:", target);
    print("", time([&] { product(0, m); }));
    std::printf("\n");
  }
  for (int chunks : chunk_counts) {
    CHECK(cublasSetSmCountTarget(handle, 0));
    std::printf("chunks %d:", chunks);
    print(" one stream", sequential(chunks));
    for (int target : {0, sms - 16, sms - 32, sms - 48}) {
      CHECK(cublasSetSmCountTarget(handle, target));
      std::printf("; two streams, GEMM on %d SMs", target == 0 ? sms : target);
      print("", overlapped(chunks));
    }
    std::printf("\n");
  }
  return 0;
}
