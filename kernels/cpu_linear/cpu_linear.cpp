// Batch-invariant y = x @ w.T on the CPU: every output element is reduced over K by one fixed
// instruction sequence, whatever the row count, the tile it falls in or the thread count.
//
// Per element (m, n): acc = 0 (16 float lanes); for each 16-wide chunk of K in order,
// acc = fma(x[m, chunk], w[n, chunk], acc); the last partial chunk is loaded zero-filled and
// taken the same way; then one fixed horizontal sum of the 16 lanes. (bfloat16 on a CPU with
// AVX512_BF16: 32-wide chunks, one VDPBF16PS each, see Ops<bf16>.) Tiles (MR rows x NR
// columns, MR <= 4, NR <= 8) only decide which elements are computed together to reuse loads;
// every tile shape runs the same per-element code (one template). Threads split the OUTPUT
// COLUMNS into blocks, which never splits an element's reduction. Compiled with
// -ffp-contract=off and without -ffast-math, so the compiler may not fuse or reorder any of it.
// bfloat16: widened to float32 exactly, accumulated in float32, rounded once (RNE).
#include <torch/extension.h>
#include <c10/util/BFloat16.h>
#include <immintrin.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <cstring>
#include <memory>
#include <mutex>
#include <thread>
#include <type_traits>
#include <vector>
#include <unistd.h>
#include <cstdlib>
#include <string>
#include <sys/syscall.h>

namespace {

using bf16 = c10::BFloat16;

#if defined(__AVX512F__)
constexpr const char* kIsa = "avx512f";
struct V { __m512 v; };
inline V vzero() { return {_mm512_setzero_ps()}; }
inline V vload(const float* p) { return {_mm512_loadu_ps(p)}; }
inline V vload(const bf16* p) {
  __m256i h = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  return {_mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16))};
}
inline V vload_part(const float* p, int n) { return {_mm512_maskz_loadu_ps((__mmask16)((1u << n) - 1), p)}; }
inline V vload_part(const bf16* p, int n) {
  __m256i h = _mm256_maskz_loadu_epi16((__mmask16)((1u << n) - 1), p);
  return {_mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16))};
}
inline V vfma(V a, V b, V c) { return {_mm512_fmadd_ps(a.v, b.v, c.v)}; }
inline float hsum(V a) {
  // fixed tree: 16 -> 8 -> 4 -> 2 -> 1 lanes
  __m256 s8 = _mm256_add_ps(_mm512_castps512_ps256(a.v), _mm512_extractf32x8_ps(a.v, 1));
  __m128 s4 = _mm_add_ps(_mm256_castps256_ps128(s8), _mm256_extractf128_ps(s8, 1));
  __m128 s2 = _mm_add_ps(s4, _mm_movehl_ps(s4, s4));
  __m128 s1 = _mm_add_ss(s2, _mm_movehdup_ps(s2));
  return _mm_cvtss_f32(s1);
}
// hsum of 16 accumulators at once: out[4 * l + q] = hsum(a[4 * q + l]). Each addition pairs the
// same two partial sums, in the same operand order, as hsum's tree (lanes i and i+8, then i and
// i+4, i and i+2, 0 and 1); the shuffles only put 16 elements' pairs side by side. So an element
// gets the same bits here as through hsum (a remainder tile's path).
inline __m512 hsum16(const __m512* a) {
  __m512 c[8], e[4], g[2];
  for (int k = 0; k < 8; ++k)   // 16 -> 8 lanes: [s8(a[2k]), s8(a[2k+1])]
    c[k] = _mm512_add_ps(_mm512_shuffle_f32x4(a[2 * k], a[2 * k + 1], 0x44),
                         _mm512_shuffle_f32x4(a[2 * k], a[2 * k + 1], 0xEE));
  for (int k = 0; k < 4; ++k)   // 8 -> 4: [s4(a[4k]), .., s4(a[4k+3])]
    e[k] = _mm512_add_ps(_mm512_shuffle_f32x4(c[2 * k], c[2 * k + 1], 0x88),
                         _mm512_shuffle_f32x4(c[2 * k], c[2 * k + 1], 0xDD));
  for (int k = 0; k < 2; ++k)   // 4 -> 2, within each 128-bit lane
    g[k] = _mm512_add_ps(_mm512_shuffle_ps(e[2 * k], e[2 * k + 1], 0x44), _mm512_shuffle_ps(e[2 * k], e[2 * k + 1], 0xEE));
  return _mm512_add_ps(_mm512_shuffle_ps(g[0], g[1], 0x88), _mm512_shuffle_ps(g[0], g[1], 0xDD));  // 2 -> 1
}
#define KVL_HSUM16 1
#elif defined(__AVX2__) && defined(__FMA__)
constexpr const char* kIsa = "avx2+fma";
struct V { __m256 lo, hi; };
inline V vzero() { return {_mm256_setzero_ps(), _mm256_setzero_ps()}; }
inline V vload(const float* p) { return {_mm256_loadu_ps(p), _mm256_loadu_ps(p + 8)}; }
inline __m256 widen8(const bf16* p) {
  __m128i h = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
}
inline V vload(const bf16* p) { return {widen8(p), widen8(p + 8)}; }
template <typename T> inline V vload_part(const T* p, int n) {
  alignas(64) T buf[16] = {};
  std::copy(p, p + n, buf);
  return vload(buf);
}
inline V vfma(V a, V b, V c) { return {_mm256_fmadd_ps(a.lo, b.lo, c.lo), _mm256_fmadd_ps(a.hi, b.hi, c.hi)}; }
inline float hsum(V a) {
  __m256 s8 = _mm256_add_ps(a.lo, a.hi);
  __m128 s4 = _mm_add_ps(_mm256_castps256_ps128(s8), _mm256_extractf128_ps(s8, 1));
  __m128 s2 = _mm_add_ps(s4, _mm_movehl_ps(s4, s4));
  __m128 s1 = _mm_add_ss(s2, _mm_movehdup_ps(s2));
  return _mm_cvtss_f32(s1);
}
#else
constexpr const char* kIsa = "generic";
struct V { float l[16]; };
inline V vzero() { return V{}; }
inline V vload(const float* p) { V r; for (int i = 0; i < 16; ++i) r.l[i] = p[i]; return r; }
inline V vload(const bf16* p) { V r; for (int i = 0; i < 16; ++i) r.l[i] = static_cast<float>(p[i]); return r; }
template <typename T> inline V vload_part(const T* p, int n) {
  T buf[16] = {};
  std::copy(p, p + n, buf);
  return vload(buf);
}
// separate multiply and add (-ffp-contract=off keeps them apart): the same on every machine
inline V vfma(V a, V b, V c) { V r; for (int i = 0; i < 16; ++i) r.l[i] = a.l[i] * b.l[i] + c.l[i]; return r; }
inline float hsum(V a) {
  float s8[8], s4[4], s2[2];
  for (int i = 0; i < 8; ++i) s8[i] = a.l[i] + a.l[i + 8];
  for (int i = 0; i < 4; ++i) s4[i] = s8[i] + s8[i + 4];
  for (int i = 0; i < 2; ++i) s2[i] = s4[i] + s4[i + 2];
  return s2[0] + s2[1];
}
#endif

// How one chunk of K is loaded and multiplied into an element's 16 float32 lanes, per dtype.
template <typename T> struct Ops {
  static constexpr int W = 16;
  using X = V;
  static X load(const T* p) { return vload(p); }
  static X part(const T* p, int n) { return vload_part(p, n); }
  static V madd(X a, X b, V acc) { return vfma(a, b, acc); }
};
#if defined(__AVX512BF16__)
// bfloat16 with AVX512_BF16: one VDPBF16PS per 32-element chunk: lane j gets the products of
// elements 2j+1 and 2j added to it in that order (exact products, float32 sums, round to
// nearest even, denormals flushed: fixed by the instruction, not by the row count).
constexpr const char* kBf16 = "dpbf16";
template <> struct Ops<bf16> {
  static constexpr int W = 32;
  using X = __m512bh;
  static X load(const bf16* p) { return (__m512bh)_mm512_loadu_si512(p); }
  static X part(const bf16* p, int n) { return (__m512bh)_mm512_maskz_loadu_epi16((__mmask32)((1ull << n) - 1), p); }
  static V madd(X a, X b, V acc) { return {_mm512_dpbf16_ps(acc.v, a, b)}; }
};
#else
constexpr const char* kBf16 = "widen-fma";
#endif

// Keep a loaded vector in a register: otherwise GCC folds its load into each FMA that uses it
// (a 4 x 4 tile then loads 20 vectors per 16 FMAs instead of 8: load-bound on Zen 4).
// An empty asm: no instruction, no effect on the arithmetic.
#if defined(__AVX512F__)
inline void pin(V& v) { asm("" : "+v"(v.v)); }
#if defined(__AVX512BF16__)
inline void pin(__m512bh& v) { asm("" : "+v"(v)); }
#endif
#else
inline void pin(V&) {}
#endif

inline void store(float* p, float v) { *p = v; }
inline void store(bf16* p, float v) { *p = bf16(v); }  // round to nearest even, once

#if defined(__AVX512F__) || !(defined(__AVX2__) && defined(__FMA__))
// The one per-element code path: MR x NR elements at a time, each reduced the same way.
template <typename TX, typename T, int MR, int NR>
void tile(const TX* x, int64_t ldx, const T* w, int64_t ldw, T* y, int64_t ldy, int64_t K) {
  static_assert(std::is_same<TX, T>::value, "x widened ahead only on AVX2");
  using O = Ops<T>;
  V acc[MR][NR];
  for (int i = 0; i < MR; ++i)
    for (int j = 0; j < NR; ++j) acc[i][j] = vzero();
  int64_t k = 0;
  for (; k + O::W <= K; k += O::W) {
    typename O::X xv[MR];
    for (int i = 0; i < MR; ++i) {
      xv[i] = O::load(x + i * ldx + k);
      if constexpr (NR > 1) pin(xv[i]);
    }
    for (int j = 0; j < NR; ++j) {
      typename O::X wv = O::load(w + j * ldw + k);
      if constexpr (MR > 1) pin(wv);
      for (int i = 0; i < MR; ++i) acc[i][j] = O::madd(xv[i], wv, acc[i][j]);
    }
  }
  if (k < K) {
    const int rest = static_cast<int>(K - k);
    typename O::X xv[MR];
    for (int i = 0; i < MR; ++i) xv[i] = O::part(x + i * ldx + k, rest);
    for (int j = 0; j < NR; ++j) {
      typename O::X wv = O::part(w + j * ldw + k, rest);
      for (int i = 0; i < MR; ++i) acc[i][j] = O::madd(xv[i], wv, acc[i][j]);
    }
  }
#if defined(KVL_HSUM16)
  if constexpr (MR == 4 && NR == 4) {   // a whole tile: its 16 lane sums together (same bits, see hsum16)
    __m512 a[16];
    for (int i = 0; i < 4; ++i)
      for (int j = 0; j < 4; ++j) a[4 * i + j] = acc[i][j].v;
    alignas(64) float out[16];
    _mm512_store_ps(out, hsum16(a));
    for (int i = 0; i < 4; ++i)
      for (int j = 0; j < 4; ++j) store(y + i * ldy + j, out[4 * j + i]);
    return;
  }
#endif
  for (int i = 0; i < MR; ++i)
    for (int j = 0; j < NR; ++j) store(y + i * ldy + j, hsum(acc[i][j]));
}

#else
// AVX2: 16 ymm registers, and an element's 16 lanes take two of them, so a 4 x 4 tile's 32
// accumulators spilled at every FMA (prefill at 0.55x of MKL on a Zen 3). But an element's low
// and high 8 lanes never meet before its lane sum: a tile runs them as two passes over K (the
// second from cache), each lane taking the same FMAs in the same order as in one pass. Same
// bits, half the registers.
inline __m256 load8(const float* p) { return _mm256_loadu_ps(p); }
inline __m256 load8(const bf16* p) { return widen8(p); }
inline void pin8(__m256& v) { asm("" : "+x"(v)); }

template <typename TX, typename T, int MR, int NR>
void tile(const TX* x, int64_t ldx, const T* w, int64_t ldw, T* y, int64_t ldy, int64_t K) {
  alignas(32) float lanes[2][MR][NR][8];
  const int64_t whole = K / 16 * 16;
  for (int h = 0; h < 2; ++h) {
    __m256 acc[MR][NR];
    for (int i = 0; i < MR; ++i)
      for (int j = 0; j < NR; ++j) acc[i][j] = _mm256_setzero_ps();
    for (int64_t k = 8 * h; k < whole; k += 16) {
      __m256 xv[MR];
      for (int i = 0; i < MR; ++i) {
        xv[i] = load8(x + i * ldx + k);
        if constexpr (NR > 1) pin8(xv[i]);
      }
      for (int j = 0; j < NR; ++j) {
        __m256 wv = load8(w + j * ldw + k);
        if constexpr (MR > 1) pin8(wv);
        for (int i = 0; i < MR; ++i) acc[i][j] = _mm256_fmadd_ps(xv[i], wv, acc[i][j]);
      }
    }
    if (whole < K) {   // the last partial chunk, zero-filled, as vload_part gives it
      const int rest = static_cast<int>(K - whole);
      __m256 xv[MR];
      for (int i = 0; i < MR; ++i) {
        V p = vload_part(x + i * ldx + whole, rest);
        xv[i] = h ? p.hi : p.lo;
      }
      for (int j = 0; j < NR; ++j) {
        V p = vload_part(w + j * ldw + whole, rest);
        for (int i = 0; i < MR; ++i) acc[i][j] = _mm256_fmadd_ps(xv[i], h ? p.hi : p.lo, acc[i][j]);
      }
    }
    for (int i = 0; i < MR; ++i)
      for (int j = 0; j < NR; ++j) _mm256_store_ps(lanes[h][i][j], acc[i][j]);
  }
  for (int i = 0; i < MR; ++i)
    for (int j = 0; j < NR; ++j)
      store(y + i * ldy + j, hsum(V{_mm256_load_ps(lanes[0][i][j]), _mm256_load_ps(lanes[1][i][j])}));
}
#define KVL_HALVES 1
#endif

template <typename TX, typename T, int MR>
void tile_cols(int nr, const TX* x, int64_t ldx, const T* w, int64_t ldw, T* y, int64_t ldy, int64_t K) {
  switch (nr) {
    case 1: return tile<TX, T, MR, 1>(x, ldx, w, ldw, y, ldy, K);
    case 2: return tile<TX, T, MR, 2>(x, ldx, w, ldw, y, ldy, K);
    case 3: return tile<TX, T, MR, 3>(x, ldx, w, ldw, y, ldy, K);
    case 4: return tile<TX, T, MR, 4>(x, ldx, w, ldw, y, ldy, K);
    case 5: return tile<TX, T, MR, 5>(x, ldx, w, ldw, y, ldy, K);
    case 6: return tile<TX, T, MR, 6>(x, ldx, w, ldw, y, ldy, K);
    case 7: return tile<TX, T, MR, 7>(x, ldx, w, ldw, y, ldy, K);
    default: return tile<TX, T, MR, 8>(x, ldx, w, ldw, y, ldy, K);
  }
}

// Output columns [n0, n1) for every row: row tiles of kMR rows x kNR columns, the last rows in
// one tile of that height, kRestNR(rows) columns wide (more independent chains when a product has
// one row, as a decode step's does).
// A few rows (a fused decode step), with AVX-512: each row alone in 1 x 8 tiles over the block,
// the block's weights from cache after the first row. Faster than 4 x 4 tiles there (measured on
// an AVX-512 Xeon, SmolLM2's products: bfloat16 4 rows 0.69x, 8 rows 0.76x; float32 4-8 rows
// 0.91-0.96x). With AVX2 the 3 x 4 tiles win at 2-8 rows too (Zen 3: 0.72-0.90x), so rows stay
// together. The same bits either way: every tile shape runs the same per-element code.
#if defined(KVL_HALVES)
constexpr int kMR = 3, kNR = 4;   // 12 accumulators + 3 rows + 1 weight vector: 16 ymm
constexpr int kRestNR(int64_t rows) { return rows == 1 ? 8 : 6; }
template <typename T> constexpr int64_t kRowwiseMin = 1 << 30;   // never
#else
constexpr int kMR = 4, kNR = 4;
constexpr int kRestNR(int64_t) { return 8; }
template <typename T> constexpr int64_t kRowwiseMin = std::is_same<T, bf16>::value ? 2 : 4;
#endif
constexpr int64_t kRowwiseMax = 8;

template <typename TX, typename T>
void column_block(const TX* x, const T* w, T* y, int64_t M, int64_t K, int64_t N, int64_t n0, int64_t n1) {
  int64_t m = 0;
  if (M >= kRowwiseMin<T> && M <= kRowwiseMax) {
    for (; m < M; ++m)
      for (int64_t n = n0; n < n1; n += 8)
        tile_cols<TX, T, 1>(static_cast<int>(std::min<int64_t>(8, n1 - n)), x + m * K, K, w + n * K, K, y + m * N + n, N, K);
    return;
  }
  for (; m + kMR <= M; m += kMR)
    for (int64_t n = n0; n < n1; n += kNR)
      tile_cols<TX, T, kMR>(static_cast<int>(std::min<int64_t>(kNR, n1 - n)), x + m * K, K, w + n * K, K, y + m * N + n, N, K);
  const int64_t rest = M - m;
  if (rest == 0) return;
  const int64_t nr_max = kRestNR(rest);
  for (int64_t n = n0; n < n1; n += nr_max) {
    const int nr = static_cast<int>(std::min<int64_t>(nr_max, n1 - n));
    const TX* xm = x + m * K;
    T* ym = y + m * N + n;
    if (rest == 1) tile_cols<TX, T, 1>(nr, xm, K, w + n * K, K, ym, N, K);
    else if (rest == 2) tile_cols<TX, T, 2>(nr, xm, K, w + n * K, K, ym, N, K);
    else tile_cols<TX, T, 3>(nr, xm, K, w + n * K, K, ym, N, K);
  }
}

// A small pool: helpers wait for a job (spinning briefly, then sleeping), claim column blocks
// from a shared counter, and the caller claims blocks too. Which thread computes a block never
// changes its bits. One job at a time: a caller that finds the pool busy (another lane's
// product) computes its own blocks alone.
class Pool {
 public:
  explicit Pool(int helpers) {
    for (int i = 0; i < helpers; ++i) threads_.emplace_back([this] { loop(); });
  }
  ~Pool() {
    {
      std::lock_guard<std::mutex> g(m_);
      stop_ = true;
      gen_.fetch_add(1);
    }
    cv_.notify_all();
    for (auto& t : threads_) t.join();
  }
  int size() const { return static_cast<int>(threads_.size()) + 1; }

  template <typename F>
  void run(int64_t blocks, const F& fn) {
    std::unique_lock<std::mutex> busy(busy_, std::try_to_lock);
    if (!busy.owns_lock() || threads_.empty() || blocks < 2) {
      for (int64_t b = 0; b < blocks; ++b) fn(b);
      return;
    }
    {
      std::lock_guard<std::mutex> g(m_);
      ctx_ = &fn;
      call_ = [](const void* c, int64_t b) { (*static_cast<const F*>(c))(b); };
      blocks_ = blocks;
      next_.store(0);
      open_ = true;
      gen_.fetch_add(1, std::memory_order_release);
    }
    cv_.notify_all();
    for (int64_t b; (b = next_.fetch_add(1)) < blocks;) fn(b);
    {
      std::lock_guard<std::mutex> g(m_);
      open_ = false;  // a helper that wakes from now on does not join
    }
    // a helper descheduled mid-block (a busy machine) needs a core: yield now and then
    for (int spins = 1; joined_.load(std::memory_order_acquire) != 0; ++spins) {
      _mm_pause();
      if (spins % 1024 == 0) std::this_thread::yield();
    }
  }

 private:
  void loop() {
    uint64_t seen = gen_.load();
    for (;;) {
      // spin ~100 us for the next product of the same forward, then sleep
      auto until = std::chrono::steady_clock::now() + std::chrono::microseconds(100);
      int spins = 0;
      while (gen_.load(std::memory_order_acquire) == seen) {
        _mm_pause();
        if (++spins % 256 == 0 && std::chrono::steady_clock::now() > until) break;
      }
      std::unique_lock<std::mutex> g(m_);
      // NOTE: stop_ in the predicate: a helper that starts after the destructor's notify (a pool
      // built and dropped at once, a set_threads right after another) read the final gen as its
      // first and would wait for ever, its join with it (a test hung in pool() so)
      cv_.wait(g, [&] { return stop_ || gen_.load() != seen; });
      seen = gen_.load();
      if (stop_) return;
      if (!open_) continue;
      joined_.fetch_add(1);
      const void* ctx = ctx_;
      void (*call)(const void*, int64_t) = call_;
      const int64_t blocks = blocks_;
      g.unlock();
      for (int64_t b; (b = next_.fetch_add(1)) < blocks;) call(ctx, b);
      joined_.fetch_sub(1, std::memory_order_release);
    }
  }

  std::vector<std::thread> threads_;
  std::mutex busy_, m_;
  std::condition_variable cv_;
  std::atomic<uint64_t> gen_{0};
  std::atomic<int64_t> next_{0};
  std::atomic<int> joined_{0};
  const void* ctx_ = nullptr;
  void (*call_)(const void*, int64_t) = nullptr;
  int64_t blocks_ = 0;
  bool open_ = false, stop_ = false;
};

std::mutex g_pool_mutex;
std::shared_ptr<Pool> g_pool;
pid_t g_pool_pid = 0;
int g_threads = 1;

std::shared_ptr<Pool> pool() {
  std::lock_guard<std::mutex> g(g_pool_mutex);
  if (g_pool && g_pool_pid != getpid()) {
    // a forked child: the parent's helper threads do not exist here; leak the old pool
    new std::shared_ptr<Pool>(std::move(g_pool));
  }
  if (!g_pool || g_pool->size() != g_threads) {
    g_pool = std::make_shared<Pool>(g_threads - 1);
    g_pool_pid = getpid();
  }
  return g_pool;
}


#if defined(__AMX_TILE__) && defined(__AMX_BF16__)
// bfloat16 through AMX tiles (Sapphire Rapids on). The weights are the tiles' A operand, read
// in place (16 weight rows x 32 elements of K, row stride K), and the rows of x are B's columns,
// packed per call into the pair-interleaved layout TDPBF16PS takes (x is small: M x K). So
// C = W . x^T, one float32 accumulator per element (weight row n, x row m), fed the K pairs of
// each 32-wide chunk in order, chunk after chunk; the last chunk of K and the rows past N are
// zero-filled (adding +0 products). Tiles only decide which elements go through an instruction
// together; an element's arithmetic reads its own row of A and column of B alone, so its bits
// never depend on the row count, the tile or the thread (tests/kernels/test_cpu_linear.py).
// They are other bits than VDPBF16PS's (one chain over K, not 16 lane sums), so every bfloat16
// product of a process takes this path once the kernel grants the tile state, and isa() says so
// (it is in the compute fingerprint: caches of the two never meet). SmolLM2's products at 512
// rows: ~1,000 GFLOP/s against ~150 through VDPBF16PS tiles (docs/BENCHMARKS.md, runs L and M).
#define KVL_AMX 1

bool request_amx() {
  const char* off = std::getenv("KVL_CPU_AMX");
  if (off && std::string(off) == "0") return false;
  // Linux gives a process the 8 KB tile state only on request (ARCH_REQ_XCOMP_PERM, XTILEDATA)
  constexpr long kReqXcompPerm = 0x1023, kXfeatureXtiledata = 18;
  return syscall(SYS_arch_prctl, kReqXcompPerm, kXfeatureXtiledata) == 0;
}
const bool g_amx = request_amx();

struct alignas(64) TileConfig {
  uint8_t palette = 1, start_row = 0, reserved[14] = {};
  uint16_t colsb[16] = {};
  uint8_t rows[16] = {};
};

// This thread's 8 tiles, every one 16 rows x 64 bytes (the one shape both kernels use); a caller
// ends with _tile_release(), so a context switch outside a kernel saves no tile state.
inline void configure_tiles() {
  TileConfig cfg;
  for (int t = 0; t < 8; ++t) {
    cfg.colsb[t] = 64;
    cfg.rows[t] = 16;
  }
  _tile_loadconfig(&cfg);
}

// Gather offsets of a 16 x 16 float tile's column: element i at 16 * i.
inline __m512i column_offsets() {
  return _mm512_mullo_epi32(_mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15),
                            _mm512_set1_epi32(16));
}

// Tiles 0-3: C (NA x NB of them, float32 16 x 16); 4-5: A (weights); 6-7: B (x, packed).
// NB == 1: the A tiles alternate between 4 and 5 (each used once per chunk).
template <int NA, int NB>
void amx_kernel(const bf16* w, int64_t ldw, const uint32_t* xp, int64_t chunks, int64_t xblocks, float* out) {
  static_assert(NA >= 1 && NA <= 4 && (NB == 1 || (NB == 2 && NA <= 2)), "at most 4 C tiles");
  _tile_zero(0);
  if constexpr (NA * NB > 1) _tile_zero(1);
  if constexpr (NA * NB > 2) _tile_zero(2);
  if constexpr (NA * NB > 3) _tile_zero(3);
  const int64_t lda = ldw * static_cast<int64_t>(sizeof(bf16));
  for (int64_t kc = 0; kc < chunks; ++kc) {
    const uint32_t* b = xp + kc * xblocks * 256;
    const bf16* a = w + kc * 32;
    _tile_loadd(6, b, 64);
    if constexpr (NB == 2) {
      _tile_loadd(7, b + 256, 64);
      _tile_loadd(4, a, lda);
      _tile_dpbf16ps(0, 4, 6);
      _tile_dpbf16ps(1, 4, 7);
      if constexpr (NA == 2) {
        _tile_loadd(5, a + 16 * ldw, lda);
        _tile_dpbf16ps(2, 5, 6);
        _tile_dpbf16ps(3, 5, 7);
      }
    } else {
      _tile_loadd(4, a, lda);
      _tile_dpbf16ps(0, 4, 6);
      if constexpr (NA > 1) { _tile_loadd(5, a + 16 * ldw, lda); _tile_dpbf16ps(1, 5, 6); }
      if constexpr (NA > 2) { _tile_loadd(4, a + 32 * ldw, lda); _tile_dpbf16ps(2, 4, 6); }
      if constexpr (NA > 3) { _tile_loadd(5, a + 48 * ldw, lda); _tile_dpbf16ps(3, 5, 6); }
    }
  }
  _tile_stored(0, out, 64);
  if constexpr (NA * NB > 1) _tile_stored(1, out + 256, 64);
  if constexpr (NA * NB > 2) _tile_stored(2, out + 512, 64);
  if constexpr (NA * NB > 3) _tile_stored(3, out + 768, 64);
}

// x [M, K] -> B tiles: tile (chunk kc, block of 16 rows mb) is 16 K pairs x 16 rows, one dword
// (two bfloat16) per (pair, row), zero past M and K; tiles in (kc, mb) order, 1 KB each.
std::vector<uint32_t> amx_pack(const bf16* x, int64_t M, int64_t K, int64_t chunks, int64_t xblocks) {
  std::vector<uint32_t> xp(static_cast<size_t>(chunks * xblocks * 256), 0);
  const int64_t pairs = K / 2;            // whole pairs: one dword each, already side by side in x
  const uint16_t* xs = reinterpret_cast<const uint16_t*>(x);
  uint32_t* d = xp.data();
  for (int64_t kc = 0; kc < chunks; ++kc)
    for (int64_t mb = 0; mb < xblocks; ++mb)
      for (int64_t k2 = 0; k2 < 16; ++k2, d += 16) {
        const int64_t kk = kc * 16 + k2;
        const int64_t rows = std::min<int64_t>(16, M - mb * 16);
        const uint16_t* src = xs + mb * 16 * K + 2 * kk;
        if (kk < pairs) {
          for (int64_t mm = 0; mm < rows; ++mm) std::memcpy(d + mm, src + mm * K, 4);
        } else if (kk == pairs && (K & 1)) {   // the last element alone, its pair's second half 0
          for (int64_t mm = 0; mm < rows; ++mm) d[mm] = src[mm * K];
        }
      }
  return xp;
}

// Column mm of a C tile (its 16 weight rows, stride 16 floats) as the first rs outputs of one row
// of y: rounded as c10::BFloat16(float) rounds (to nearest even; NaN -> 0x7FC0), 16 at a time.
inline void store_column(const float* c, int rs, bf16* y) {
  const __m512 v = _mm512_i32gather_ps(column_offsets(), c, 4);
  const __m512i u = _mm512_castps_si512(v);
  const __m512i bias = _mm512_add_epi32(_mm512_and_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(1)),
                                        _mm512_set1_epi32(0x7FFF));
  __m512i r = _mm512_srli_epi32(_mm512_add_epi32(u, bias), 16);
  r = _mm512_mask_mov_epi32(r, _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q), _mm512_set1_epi32(0x7FC0));
  _mm256_mask_storeu_epi16(y, static_cast<__mmask16>((1u << rs) - 1), _mm512_cvtepi32_epi16(r));
}

// Weight rows [r0, r1) (r0 a multiple of 16) for every row of x: y[m, n] for n in [r0, r1).
void amx_rows(const uint32_t* xp, int64_t M, int64_t K, int64_t chunks, int64_t xblocks, const bf16* w,
              int64_t N, bf16* y, int64_t r0, int64_t r1) {
  configure_tiles();
  const int nb = M > 16 ? 2 : 1;
  const int group = nb == 2 ? 2 : 4;                     // weight-row tiles per kernel call
  alignas(64) float out[4 * 256];
  std::vector<bf16> pad;
  for (int64_t g0 = r0; g0 < r1; g0 += 16 * group) {
    const int na = static_cast<int>(std::min<int64_t>(group, (r1 - g0 + 15) / 16));
    const int64_t rows = std::min<int64_t>(16 * na, r1 - g0);
    const bf16* wa = w + g0 * K;
    int64_t ldw = K;
    if (K % 32 != 0 || rows < 16 * na) {    // zero-filled to whole tiles: a copy of these rows
      ldw = chunks * 32;
      pad.assign(static_cast<size_t>(16 * na * ldw), bf16(0.0f));
      for (int64_t r = 0; r < rows; ++r) std::copy(wa + r * K, wa + (r + 1) * K, pad.data() + r * ldw);
      wa = pad.data();
    }
    for (int64_t mb = 0; mb < xblocks; mb += nb) {
      const int nbh = static_cast<int>(std::min<int64_t>(nb, xblocks - mb));
      const uint32_t* xb = xp + mb * 256;
      if (nbh == 2) {
        if (na == 2) amx_kernel<2, 2>(wa, ldw, xb, chunks, xblocks, out);
        else amx_kernel<1, 2>(wa, ldw, xb, chunks, xblocks, out);
      } else {
        switch (na) {
          case 1: amx_kernel<1, 1>(wa, ldw, xb, chunks, xblocks, out); break;
          case 2: amx_kernel<2, 1>(wa, ldw, xb, chunks, xblocks, out); break;
          case 3: amx_kernel<3, 1>(wa, ldw, xb, chunks, xblocks, out); break;
          default: amx_kernel<4, 1>(wa, ldw, xb, chunks, xblocks, out); break;
        }
      }
      for (int a = 0; a < na; ++a)
        for (int b = 0; b < nbh; ++b) {
          const float* c = out + (a * nbh + b) * 256;   // [weight row r][x row mm]
          const int rs = static_cast<int>(std::min<int64_t>(16, rows - 16 * a));
          for (int mm = 0; mm < 16 && (mb + b) * 16 + mm < M; ++mm)
            store_column(c + mm, rs, y + ((mb + b) * 16 + mm) * N + g0 + 16 * a);
        }
    }
  }
  _tile_release();
}
#endif
}  // namespace

void set_threads(int64_t n) {
  std::lock_guard<std::mutex> g(g_pool_mutex);
  g_threads = static_cast<int>(std::max<int64_t>(1, n));
}

int64_t get_threads() { return g_threads; }

std::string isa() {
#if defined(KVL_AMX)
  if (g_amx) return std::string(kIsa) + ", bfloat16 amx";
#endif
  return std::string(kIsa) + ", bfloat16 " + kBf16;
}

// Columns per block of a product N wide on T threads: a multiple of 8, at most 64 (a block's
// weights stay in cache while the row tiles pass over them), at most ~N / 4T (~4 blocks per
// thread), chosen so the thread with the most blocks has the fewest columns: 576 columns on 2
// threads as 12 blocks of 48, not 9 of 64, where one thread would take 5 blocks and the other
// 4 and wait (SmolLM2's o and down products, 1 / 3 of a layer's weights). The split changes
// who computes a column, never how.
int64_t block_columns(int64_t N, int64_t T) {
  const int64_t most = std::min<int64_t>(64, std::max<int64_t>(8, (N / (4 * T) + 7) / 8 * 8));
  if (T <= 1) return most;
  int64_t best = most, cost = INT64_MAX;
  for (int64_t nb = most; nb >= 8; nb -= 8) {
    const int64_t blocks = (N + nb - 1) / nb;
    const int64_t c = (blocks + T - 1) / T * nb;   // the columns of the busiest thread
    if (c < cost) best = nb, cost = c;
  }
  return best;
}

torch::Tensor linear(torch::Tensor x, torch::Tensor w, int64_t threads) {
  TORCH_CHECK(x.device().is_cpu() && w.device().is_cpu(), "cpu_linear: CPU tensors only");
  TORCH_CHECK(x.dim() == 2 && w.dim() == 2 && x.size(1) == w.size(1), "cpu_linear: x [M, K], w [N, K]");
  TORCH_CHECK(x.scalar_type() == w.scalar_type(), "cpu_linear: x and w of one dtype");
  TORCH_CHECK(x.scalar_type() == at::kFloat || x.scalar_type() == at::kBFloat16, "cpu_linear: float32 or bfloat16");
  x = x.contiguous();
  w = w.contiguous();
  const int64_t M = x.size(0), K = x.size(1), N = w.size(0);
  auto y = torch::empty({M, N}, x.options());
  if (M == 0 || N == 0) return y;
  if (K == 0) return y.zero_();
  // a product of under ~256K multiply-adds (a tiny model's) is done before a helper could join
  const bool alone = threads == 1 || M * N * K < (int64_t{1} << 18);
  std::shared_ptr<Pool> p = alone ? nullptr : pool();
  const int64_t T = p ? p->size() : 1;
#if defined(KVL_AMX)
  if (g_amx && x.scalar_type() == at::kBFloat16) {
    const int64_t chunks = (K + 31) / 32, xblocks = (M + 15) / 16;
    const std::vector<uint32_t> xp = amx_pack(x.data_ptr<bf16>(), M, K, chunks, xblocks);
    // blocks of 16..64 weight rows, ~4 per thread
    const int64_t rb = std::min<int64_t>(64, std::max<int64_t>(16, N / (4 * T) / 16 * 16));
    const int64_t rblocks = (N + rb - 1) / rb;
    const bf16* wp = w.data_ptr<bf16>();
    bf16* yp = y.data_ptr<bf16>();
    auto fn = [&](int64_t b) { amx_rows(xp.data(), M, K, chunks, xblocks, wp, N, yp, b * rb, std::min(N, (b + 1) * rb)); };
    if (p) p->run(rblocks, fn);
    else for (int64_t b = 0; b < rblocks; ++b) fn(b);
    return y;
  }
#endif
  const int64_t nb = block_columns(N, T);
  const int64_t blocks = (N + nb - 1) / nb;
  auto go = [&](auto* xp, auto* wp, auto* yp) {
    auto fn = [&](int64_t b) { column_block(xp, wp, yp, M, K, N, b * nb, std::min(N, (b + 1) * nb)); };
    if (p) p->run(blocks, fn);
    else for (int64_t b = 0; b < blocks; ++b) fn(b);
  };
  if (x.scalar_type() == at::kFloat) {
    go(x.data_ptr<float>(), w.data_ptr<float>(), y.data_ptr<float>());
#if defined(KVL_HALVES)
  } else if (M >= 2) {
    // AVX2 widens bfloat16 by two instructions a vector: a row's, widened once here (exactly),
    // is not widened again for every tile of columns that reads it
    auto xf = x.to(at::kFloat);
    go(xf.data_ptr<float>(), w.data_ptr<bf16>(), y.data_ptr<bf16>());
#endif
  } else {
    go(x.data_ptr<bf16>(), w.data_ptr<bf16>(), y.data_ptr<bf16>());
  }
  return y;
}
