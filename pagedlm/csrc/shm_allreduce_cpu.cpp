// All-reduce (sum) and all-gather of float32 tensors between the tensor-parallel ranks of one
// machine,
// through a shared-memory segment every rank maps: what gloo over loopback does in hundreds of
// microseconds per call, this does in a few, which matters because a decoder layer makes two
// calls per step on the critical path. The all-gather (the LM head's vocabulary shards, once
// per step) uses the same rounds, each rank then copying every slot out.
//
// Segment layout (one file under /dev/shm, zeroed at creation, mapped by every rank):
//
//   flags:  [world] x 64 bytes         flag[r] = the last round rank r has published (int64,
//                                      one cache line each, so ranks never share a line)
//   slots:  [2][world][chunk] float32  slot[s & 1][r] = rank r's input for round s
//
// One round per chunk of at most `chunk` elements; round numbers s = 1, 2, ... are the same on
// every rank because every rank makes the same sequence of calls. Round s on rank r:
//   1. copy its chunk into slot[s & 1][r]
//   2. flag[r] = s                                     (release: the copy is visible first)
//   3. wait until flag[p] >= s for every rank p        (acquire: their copies are visible)
//   4. x_chunk = slot[s & 1][0] + slot[s & 1][1] + ...  in rank order, on every rank, so all
//                                                       ranks get bit-identical sums
// Two slot sets make that safe without a second barrier: rank r writes slot[s & 1] again in
// round s + 2, which it reaches only after every flag said s + 1, and a rank publishes s + 1
// only after it has finished reading round s.
//
// A peer that dies leaves its flag behind and the others would spin forever: the wait gives up
// after `timeout_ms` and raises, and the engine (which watches the processes) kills every rank.

#include "lite_bind.h"

#include <atomic>
#include <chrono>
#include <cstdint>
#include <cstring>
#include <stdexcept>
#include <thread>

#if defined(__x86_64__)
#include <immintrin.h>
#define SPIN_PAUSE() _mm_pause()
#else
#define SPIN_PAUSE() std::this_thread::yield()
#endif

namespace {

constexpr int64_t kFlagBytes = 64;

struct Segment {
  uint8_t* base;
  int64_t world;
  int64_t chunk;

  std::atomic<int64_t>* flag(int64_t rank) const {
    return reinterpret_cast<std::atomic<int64_t>*>(base + rank * kFlagBytes);
  }
  float* slot(int64_t round, int64_t rank) const {
    float* slots = reinterpret_cast<float*>(base + world * kFlagBytes);
    return slots + ((round & 1) * world + rank) * chunk;
  }
};

void wait_for_round(const Segment& seg, int64_t round, int64_t timeout_ms) {
  auto start = std::chrono::steady_clock::now();
  for (int64_t p = 0; p < seg.world; ++p) {
    int64_t spins = 0;
    while (seg.flag(p)->load(std::memory_order_acquire) < round) {
      SPIN_PAUSE();
      if (++spins % 4096 == 0) {
        auto waited = std::chrono::steady_clock::now() - start;
        if (std::chrono::duration_cast<std::chrono::milliseconds>(waited).count() > timeout_ms) {
          throw std::runtime_error("shared-memory all-reduce: rank " + std::to_string(p) +
                                   " did not reach round " + std::to_string(round));
        }
        if (spins > (1 << 20)) std::this_thread::yield();  // a long wait: let others run
      }
    }
  }
}

Segment checked_segment(const torch::Tensor& segment, int64_t rank, int64_t world,
                        int64_t chunk, const torch::Tensor& x) {
  TORCH_CHECK(x.scalar_type() == torch::kFloat32 && x.is_contiguous() && x.is_cpu(),
              "x must be a contiguous float32 CPU tensor");
  TORCH_CHECK(segment.scalar_type() == torch::kUInt8 && segment.is_contiguous() &&
                  segment.numel() >= world * kFlagBytes + 2 * world * chunk * 4,
              "segment too small for ", world, " ranks of ", chunk, " floats");
  TORCH_CHECK(0 <= rank && rank < world, "rank out of range");
  return Segment{segment.data_ptr<uint8_t>(), world, chunk};
}

}  // namespace

// Sums `x` (contiguous float32, any shape) over the ranks in place; returns the next round.
// data[0:n] summed over the ranks in place, from round `round` on; returns the next round.
// Raw pointers and no GIL handling: the C++ decoder calls it between its layers.
int64_t all_reduce_rounds(const Segment& seg, int64_t rank, int64_t round, float* data, int64_t n,
                          int64_t timeout_ms) {
  const int64_t chunk = seg.chunk;
  for (int64_t offset = 0; offset < n; offset += chunk, ++round) {
    const int64_t len = std::min(chunk, n - offset);
    std::memcpy(seg.slot(round, rank), data + offset, len * sizeof(float));
    seg.flag(rank)->store(round, std::memory_order_release);
    wait_for_round(seg, round, timeout_ms);
    float* out = data + offset;
    const float* first = seg.slot(round, 0);
    for (int64_t i = 0; i < len; ++i) out[i] = first[i];
    for (int64_t p = 1; p < seg.world; ++p) {
      const float* in = seg.slot(round, p);
      for (int64_t i = 0; i < len; ++i) out[i] += in[i];
    }
  }
  return round;
}

int64_t all_reduce(torch::Tensor segment, int64_t rank, int64_t world, int64_t chunk,
                   int64_t round, torch::Tensor x, int64_t timeout_ms) {
  Segment seg = checked_segment(segment, rank, world, chunk, x);
  pagedlm_lite::gil_scoped_release no_gil;
  return all_reduce_rounds(seg, rank, round, x.data_ptr<float>(), x.numel(), timeout_ms);
}

// Gathers every rank's `x` (contiguous float32, the same numel on every rank) into
// out[world, numel]: out[p] = rank p's x. Rounds as in all_reduce (copy in, publish, wait),
// then each rank copies every slot out; returns the next round.
int64_t all_gather(torch::Tensor segment, int64_t rank, int64_t world, int64_t chunk,
                   int64_t round, torch::Tensor x, torch::Tensor out, int64_t timeout_ms) {
  TORCH_CHECK(out.scalar_type() == torch::kFloat32 && out.is_contiguous() &&
                  out.numel() == world * x.numel(),
              "out must be a contiguous float32 tensor of world * x.numel() elements");
  Segment seg = checked_segment(segment, rank, world, chunk, x);
  const float* data = x.data_ptr<float>();
  float* result = out.data_ptr<float>();
  const int64_t n = x.numel();
  pagedlm_lite::gil_scoped_release no_gil;
  for (int64_t offset = 0; offset < n; offset += chunk, ++round) {
    const int64_t len = std::min(chunk, n - offset);
    std::memcpy(seg.slot(round, rank), data + offset, len * sizeof(float));
    seg.flag(rank)->store(round, std::memory_order_release);
    wait_for_round(seg, round, timeout_ms);
    for (int64_t p = 0; p < world; ++p) {
      std::memcpy(result + p * n + offset, seg.slot(round, p), len * sizeof(float));
    }
  }
  return round;
}

int64_t segment_bytes(int64_t world, int64_t chunk) {
  return world * kFlagBytes + 2 * world * chunk * 4;
}

// Its Python functions, bound into the decoder's module (llama_decode_cpu.cpp), which
// compiles this file with its own and calls all_reduce_rounds between its layers.
inline void bind_shm_allreduce_cpu(lite_bind::Module& m) {
  m.def<&all_reduce>("all_reduce", "In-place sum of x over the ranks; returns the next round "
                                    "(segment, rank, world, chunk, round, x, timeout_ms)");
  m.def<&all_gather>("all_gather", "out[p] = rank p's x; returns the next round "
                                    "(segment, rank, world, chunk, round, x, out, timeout_ms)");
  m.def<&segment_bytes>("segment_bytes", "Bytes of the segment for world ranks and chunk floats");
}
