// A dense layer's small ops, each giving exactly the bits of the torch expression it replaces
// (kernels/layer_ops.py holds those expressions and probes these against them at start-up).
// Why: a decode step runs ~50 small torch ops per layer, each ~5 us of dispatch from Python, on
// a few hundred elements: at one row that is a third of SmolLM2's step. Here each is one call.
//
// * cast_rms_norm: transformers' LlamaRMSNorm as worker.model.norms.CastRMSNorm computes it.
//   The mean of squares reproduces ATen's CPU sum of a contiguous float32 row (SumKernel.cpp's
//   vectorized inner sum: vectors of L lanes taken 4 at a time into 4 accumulators, cascaded in
//   levels for long rows, leftover vectors into the first, the 4 added in order, then the lanes
//   in order), then the division by n; squares, rsqrt, products and casts are elementwise and
//   correctly rounded, so they match whatever path torch takes.
// * rope: x*cos + rotate_half(x)*sin, each product and the sum rounded to the dtype as torch does.
// Compiled with -ffp-contract=off: no multiply and add fused that the source keeps apart.

#include <ATen/ThreadLocalState.h>

namespace {

inline int64_t aten_ceil_log2(int64_t x) {   // c10's CeilLog2 as SumKernel.cpp uses it
  if (x <= 2) return 1;
  int64_t b = 0;
  for (uint64_t u = static_cast<uint64_t>(x) - 1; u; u >>= 1) ++b;
  return b;
}

template <int L> struct Lanes {
  float v[L];
  void zero() { for (int l = 0; l < L; ++l) v[l] = 0.f; }
  void add(const Lanes& o) { add(o.v); }
  void add(const float* p) { for (int l = 0; l < L; ++l) v[l] = v[l] + p[l]; }
};

// ATen's float32 sum of sq[0..n) (n a multiple of L, at least L): see the header.
template <int L>
float aten_row_sum(const float* sq, int64_t n) {
  constexpr int kIlp = 4, kLevels = 4;
  const int64_t nvec = n / L, size = nvec / kIlp;
  const int64_t level_power = std::max<int64_t>(4, aten_ceil_log2(size) / kLevels);
  const int64_t level_step = int64_t{1} << level_power, level_mask = level_step - 1;
  Lanes<L> acc[kLevels][kIlp];
  for (auto& lv : acc)
    for (auto& a : lv) a.zero();
  auto vec = [&](int64_t i) { return sq + i * L; };
  int64_t i = 0;
  while (i + level_step <= size) {
    for (int64_t j = 0; j < level_step; ++j, ++i)
      for (int k = 0; k < kIlp; ++k) acc[0][k].add(vec(i * kIlp + k));
    for (int j = 1; j < kLevels; ++j) {
      for (int k = 0; k < kIlp; ++k) {
        acc[j][k].add(acc[j - 1][k]);
        acc[j - 1][k].zero();
      }
      if ((i & (level_mask << (j * level_power))) != 0) break;
    }
  }
  for (; i < size; ++i)
    for (int k = 0; k < kIlp; ++k) acc[0][k].add(vec(i * kIlp + k));
  for (int j = 1; j < kLevels; ++j)
    for (int k = 0; k < kIlp; ++k) acc[0][k].add(acc[j][k]);
  for (int64_t v = size * kIlp; v < nvec; ++v) acc[0][0].add(vec(v));
  for (int k = 1; k < kIlp; ++k) acc[0][0].add(acc[0][k]);
  float total = 0.f;
  for (int l = 0; l < L; ++l) total += acc[0][0].v[l];
  return total;
}

// widen(): cpu_attention.cpp's (float32 as is, bfloat16 exactly)
template <typename T> inline T narrow(float v) { return static_cast<T>(v); }   // bf16: round to nearest even

template <typename T, int L>
void cast_rms_norm_rows(const T* x, int64_t ldx, const T* w, T* y, int64_t rows, int64_t n, float eps) {
  std::vector<float> sq(n), xf(n);
  for (int64_t r = 0; r < rows; ++r) {
    const T* xr = x + r * ldx;
    for (int64_t j = 0; j < n; ++j) {
      xf[j] = widen(xr[j]);
      sq[j] = xf[j] * xf[j];
    }
    const float ms = aten_row_sum<L>(sq.data(), n) / static_cast<float>(n);
    const float inv = 1.0f / std::sqrt(ms + eps);
    T* yr = y + r * n;
    for (int64_t j = 0; j < n; ++j) {
      const T normed = narrow<T>(xf[j] * inv);            // float32, cast back to x's dtype
      yr[j] = narrow<T>(widen(w[j]) * widen(normed));      // then the weight, in that dtype
    }
  }
}

template <typename T>
void rope_rows(const T* x, int64_t ldx, int64_t heads, int64_t D, const T* cos, const T* sin,
               int64_t ldc, T* y, int64_t rows) {
  const int64_t half = D / 2;
  for (int64_t r = 0; r < rows; ++r) {
    const T* c = cos + r * ldc;
    const T* s = sin + r * ldc;
    for (int64_t h = 0; h < heads; ++h) {
      const T* xh = x + r * ldx + h * D;
      T* yh = y + (r * heads + h) * D;
      for (int64_t j = 0; j < D; ++j) {
        const float rot = j < half ? -widen(xh[j + half]) : widen(xh[j - half]);
        const T a = narrow<T>(widen(xh[j]) * widen(c[j]));
        const T b = narrow<T>(rot * widen(s[j]));
        yh[j] = narrow<T>(widen(a) + widen(b));
      }
    }
  }
}

bool norm_lanes_ok(int64_t lanes) { return lanes == 8 || lanes == 16; }

// fn(r0, r1) over [0, rows) in blocks of rows on the product's pool: a row's values never depend
// on which block or thread computes it (these ops are row by row), so the bits do not change.
// A call of under ~64K elements is done before a helper could join.
template <typename F>
void for_rows(int64_t rows, int64_t row_elems, const F& fn) {
  const int64_t T = get_threads();
  if (T < 2 || rows < 2 || rows * row_elems < (int64_t{1} << 16)) {
    fn(int64_t{0}, rows);
    return;
  }
  const int64_t per = std::max<int64_t>(1, (rows + 4 * T - 1) / (4 * T));   // ~4 blocks per thread
  const int64_t blocks = (rows + per - 1) / per;
  // the caller's thread-local state (grad and inference mode) for ATen calls on the helpers, as
  // at::parallel_for passes it: an inference tensor may only be written in inference mode
  const at::ThreadLocalState tls;
  pool()->run(blocks, [&](int64_t b) {
    at::ThreadLocalStateGuard guard(tls);
    fn(b * per, std::min(rows, (b + 1) * per));
  });
}

}  // namespace

torch::Tensor cast_rms_norm(torch::Tensor x, torch::Tensor w, double eps, int64_t lanes) {
  TORCH_CHECK(x.device().is_cpu() && w.device().is_cpu(), "cast_rms_norm: CPU tensors only");
  TORCH_CHECK(x.scalar_type() == w.scalar_type(), "cast_rms_norm: x and weight of one dtype");
  TORCH_CHECK(x.scalar_type() == at::kFloat || x.scalar_type() == at::kBFloat16, "cast_rms_norm: float32 or bfloat16");
  TORCH_CHECK(norm_lanes_ok(lanes), "cast_rms_norm: lanes 8 or 16");
  const int64_t n = x.size(-1);
  TORCH_CHECK(w.dim() == 1 && w.size(0) == n && n % lanes == 0, "cast_rms_norm: weight [n], n a multiple of the lanes");
  auto x2 = x.reshape({-1, n});
  if (x2.stride(1) != 1) x2 = x2.contiguous();
  auto wc = w.contiguous();
  auto y = torch::empty(x.sizes(), x.options());
  const int64_t rows = x2.size(0);
  const float e = static_cast<float>(eps);
  auto go = [&](auto* xp, auto* wp, auto* yp) {
    using T = std::remove_const_t<std::remove_pointer_t<decltype(xp)>>;
    const int64_t ld = x2.stride(0);
    for_rows(rows, n, [&](int64_t r0, int64_t r1) {
      if (lanes == 16) cast_rms_norm_rows<T, 16>(xp + r0 * ld, ld, wp, yp + r0 * n, r1 - r0, n, e);
      else cast_rms_norm_rows<T, 8>(xp + r0 * ld, ld, wp, yp + r0 * n, r1 - r0, n, e);
    });
  };
  if (x.scalar_type() == at::kFloat) go(x2.data_ptr<float>(), wc.data_ptr<float>(), y.data_ptr<float>());
  else go(x2.data_ptr<bf16>(), wc.data_ptr<bf16>(), y.data_ptr<bf16>());
  return y;
}

torch::Tensor rope(torch::Tensor x, torch::Tensor cos, torch::Tensor sin) {
  TORCH_CHECK(x.device().is_cpu() && cos.device().is_cpu() && sin.device().is_cpu(), "rope: CPU tensors only");
  TORCH_CHECK(x.dim() == 3 && cos.dim() == 2 && sin.sizes() == cos.sizes(), "rope: x [N, heads, D], cos/sin [N, D]");
  TORCH_CHECK(x.scalar_type() == cos.scalar_type() && sin.scalar_type() == cos.scalar_type(), "rope: one dtype");
  TORCH_CHECK(x.scalar_type() == at::kFloat || x.scalar_type() == at::kBFloat16, "rope: float32 or bfloat16");
  const int64_t N = x.size(0), H = x.size(1), D = x.size(2);
  TORCH_CHECK(D % 2 == 0 && cos.size(0) == N && cos.size(1) == D, "rope: even D, one cos/sin row per row of x");
  // rows may be strided (a view of a fused product); each row's heads must lie contiguously
  if (!(x.stride(2) == 1 && x.stride(1) == D)) x = x.contiguous();
  auto c = cos, s = sin;
  if (!(c.stride(1) == 1 && s.stride(1) == 1 && c.stride(0) == s.stride(0))) {
    c = cos.contiguous();
    s = sin.contiguous();
  }
  auto y = torch::empty({N, H, D}, x.options());
  auto go = [&](auto* xp, auto* cp, auto* sp, auto* yp) {
    const int64_t lx = x.stride(0), lc = c.stride(0);
    for_rows(N, H * D, [&](int64_t r0, int64_t r1) {
      rope_rows(xp + r0 * lx, lx, H, D, cp + r0 * lc, sp + r0 * lc, lc, yp + r0 * H * D, r1 - r0);
    });
  };
  if (x.scalar_type() == at::kFloat)
    go(x.data_ptr<float>(), c.data_ptr<float>(), s.data_ptr<float>(), y.data_ptr<float>());
  else
    go(x.data_ptr<bf16>(), c.data_ptr<bf16>(), s.data_ptr<bf16>(), y.data_ptr<bf16>());
  return y;
}

// silu(gate) * up as kernels.invariant.pointwise(F.silu, gate) * up computes it, for a gate whose
// element count is a whole number of ATen's vectors (the caller checks): ATen's own silu over the
// gate made contiguous (every element on the vector path, as pointwise arranges), then the product.
// Rows of a 2-D gate may go to the pool in blocks: each block is a whole number of rows, so of
// ATen's vectors when a row is (the layer's intermediate size, a multiple of 64), and an
// element's bits do not depend on the block it is computed in.
torch::Tensor silu_mul(torch::Tensor gate, torch::Tensor up) {
  TORCH_CHECK(gate.sizes() == up.sizes() && gate.scalar_type() == up.scalar_type(), "silu_mul: gate and up alike");
  const int64_t row = gate.dim() == 2 ? gate.size(1) : 0;
  if (row == 0 || row % 64) {
    auto y = at::silu(gate.contiguous());
    return y.mul_(up);
  }
  auto g = gate.contiguous();
  auto y = torch::empty_like(g);
  for_rows(g.size(0), row, [&](int64_t r0, int64_t r1) {
    auto yb = y.narrow(0, r0, r1 - r0);
    at::silu_out(yb, g.narrow(0, r0, r1 - r0));
    yb.mul_(up.narrow(0, r0, r1 - r0));
  });
  return y;
}

namespace {

// a + b (an ordinary add, as the modules' residual `x + y`) with blocks of rows on the pool: an
// add is exact per element, whatever the block.
torch::Tensor add_rows(const torch::Tensor& a, const torch::Tensor& b) {
  if (a.dim() != 2 || a.sizes() != b.sizes() || a.scalar_type() != b.scalar_type() || !a.is_contiguous() ||
      !b.is_contiguous())
    return a + b;
  auto y = torch::empty_like(a);
  for_rows(a.size(0), a.size(1), [&](int64_t r0, int64_t r1) {
    auto yb = y.narrow(0, r0, r1 - r0);
    at::add_out(yb, a.narrow(0, r0, r1 - r0), b.narrow(0, r0, r1 - r0));
  });
  return y;
}

}  // namespace

namespace {

// A product as kernels.invariant._linear computes it: the compiled kernel over the rows, then
// the bias added (an ordinary add, as `y = y + bias`).
torch::Tensor product(const torch::Tensor& x, const torch::Tensor& w, const std::optional<torch::Tensor>& b) {
  auto y = linear(x.reshape({-1, x.size(-1)}), w, 0);
  if (b.has_value()) y = y + *b;
  return y;
}

torch::Tensor silu_mul_any(const torch::Tensor& gate, const torch::Tensor& up) {
  TORCH_CHECK(gate.numel() % 64 == 0, "dense_layer: the gate's element count a multiple of 64");
  return silu_mul(gate, up);
}

}  // namespace

// One dense decoder layer (worker.model.dense.model.DenseLayer on the in-place attention path) as
// ONE call: the same functions in the same order as the Python modules run them — norm, fused
// q/k/v product (+ bias), optional q/k norms, rope, the in-place attention, o product, residual
// add, norm, fused gate/up product, silu * up, down product, residual add — so the same bits,
// without ~25 Python calls per layer.
torch::Tensor dense_layer(torch::Tensor x, torch::Tensor ln1, torch::Tensor ln2, double eps, int64_t lanes,
                          torch::Tensor w_qkv, std::optional<torch::Tensor> b_qkv,
                          std::optional<torch::Tensor> q_norm, std::optional<torch::Tensor> k_norm, double qk_eps,
                          torch::Tensor cos, torch::Tensor sin, int64_t heads, int64_t kv_heads, int64_t head_dim,
                          torch::Tensor w_o, std::optional<torch::Tensor> b_o, torch::Tensor w_gate_up,
                          std::optional<torch::Tensor> b_gate_up, torch::Tensor w_down,
                          std::optional<torch::Tensor> b_down, std::vector<torch::Tensor> kbufs,
                          std::vector<torch::Tensor> vbufs, int64_t layer, std::vector<int64_t> starts,
                          std::vector<int64_t> rows, torch::Tensor pos, std::vector<int64_t> key_lo, int64_t window,
                          double scale, std::vector<torch::Tensor> prefixes, int64_t block_size) {
  const int64_t N = x.size(0), H = heads, kvh = kv_heads, D = head_dim;
  TORCH_CHECK(x.dim() == 2 && w_qkv.size(0) == (H + 2 * kvh) * D, "dense_layer: x [N, hidden], w_qkv [(H + 2 kvh) D, hidden]");
  auto h = cast_rms_norm(x, ln1, eps, lanes);
  auto qkv = product(h, w_qkv, b_qkv);
  auto parts = qkv.split_with_sizes({H * D, kvh * D, kvh * D}, -1);
  auto q = parts[0].view({N, H, D}), k = parts[1].view({N, kvh, D}), v = parts[2].view({N, kvh, D});
  if (q_norm.has_value()) {
    q = cast_rms_norm(q.contiguous(), *q_norm, qk_eps, lanes);
    k = cast_rms_norm(k.contiguous(), *k_norm, qk_eps, lanes);
  }
  q = rope(q, cos, sin);
  k = rope(k, cos, sin);
  auto o = attention_cached(q, k, v, kbufs, vbufs, layer, starts, rows, pos, key_lo, window, scale, 0, prefixes,
                            block_size);
  x = add_rows(x, product(o.to(q.scalar_type()).reshape({N, -1}), w_o, b_o));
  auto gu = product(cast_rms_norm(x, ln2, eps, lanes), w_gate_up, b_gate_up);
  const int64_t I = w_down.size(1);
  auto gup = gu.split_with_sizes({I, I}, -1);
  return add_rows(x, product(silu_mul_any(gup[0], gup[1]), w_down, b_down));
}
