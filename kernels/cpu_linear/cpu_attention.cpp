// Batch-invariant causal attention on the CPU, reading each request's K/V where they lie.
// Compiled in one unit after cpu_linear.cpp (its vector ops and thread pool), then the bindings.
//
// One query row r (at absolute position t) and one query head h of kv head h / g: the keys it
// sees are the positions a..t, a = max(0, t - window + 1) (window 0: a = 0), in order. Per key,
// the score is a dot product over the head dim by the product's own per-element code (16 float
// lanes, one FMA per 16-wide chunk, a fixed lane tree), times the scale. The softmax: the max
// (exact in any order), exp by the polynomial below (IEEE +, -, * and exact bit moves only, so a
// lane of a vector and a scalar tail give the same bits), the denominator in 16 lanes by the
// key's offset from a, then the lane tree. The output: per head-dim element, the sum over keys
// in order of p * v (a multiply, then an add), divided by the denominator once. Nothing of it
// depends on which other rows, requests or keys share the call, how a prompt is cut, or which
// thread runs the item: a decode step, a prefill unit and a batch give a query the same bits.
// bfloat16 K/V/q are widened exactly; the result is float32 (the caller rounds once).

namespace {

// Cephes' expf, for x <= 0: x = n ln2 + r, exp(r) by a degree-7 polynomial, times 2^n built
// from bits. Written without branches or libm: every element takes the same instructions.
inline float kexp(float x) {
  x = x < -87.0f ? -87.0f : x;                       // below: 2^-126 scale would be denormal
  const float magic = 12582912.0f;                   // 1.5 * 2^23: v + magic - magic rounds v to an integer (RNE)
  float n = (x * 1.44269504088896341f + magic) - magic;
  float r = x - n * 0.693359375f;                    // Cody-Waite: ln2 = hi + lo, hi exact in few bits
  r = r - n * -2.12194440e-4f;
  float p = 1.9875691500e-4f;
  p = p * r + 1.3981999507e-3f;
  p = p * r + 8.3334519073e-3f;
  p = p * r + 4.1665795894e-2f;
  p = p * r + 1.6666665459e-1f;
  p = p * r + 5.0000001201e-1f;
  float y = p * (r * r) + r + 1.0f;
  int32_t e = (static_cast<int32_t>(n) + 127) << 23;
  float scale;
  std::memcpy(&scale, &e, sizeof scale);
  return y * scale;
}

#if defined(KVL_HSUM16)
// kexp on 16 lanes: the same operations in the same order, so a lane's bits are kexp's.
// (max(-87, x) keeps a NaN x as the scalar's comparison does.)
inline __m512 kexp16(__m512 x) {
  x = _mm512_max_ps(_mm512_set1_ps(-87.0f), x);
  const __m512 magic = _mm512_set1_ps(12582912.0f);
  const __m512 n = _mm512_sub_ps(_mm512_add_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f)), magic), magic);
  __m512 r = _mm512_sub_ps(x, _mm512_mul_ps(n, _mm512_set1_ps(0.693359375f)));
  r = _mm512_sub_ps(r, _mm512_mul_ps(n, _mm512_set1_ps(-2.12194440e-4f)));
  __m512 p = _mm512_set1_ps(1.9875691500e-4f);
  p = _mm512_add_ps(_mm512_mul_ps(p, r), _mm512_set1_ps(1.3981999507e-3f));
  p = _mm512_add_ps(_mm512_mul_ps(p, r), _mm512_set1_ps(8.3334519073e-3f));
  p = _mm512_add_ps(_mm512_mul_ps(p, r), _mm512_set1_ps(4.1665795894e-2f));
  p = _mm512_add_ps(_mm512_mul_ps(p, r), _mm512_set1_ps(1.6666665459e-1f));
  p = _mm512_add_ps(_mm512_mul_ps(p, r), _mm512_set1_ps(5.0000001201e-1f));
  const __m512 y = _mm512_add_ps(_mm512_add_ps(_mm512_mul_ps(p, _mm512_mul_ps(r, r)), r), _mm512_set1_ps(1.0f));
  const __m512i e = _mm512_slli_epi32(_mm512_add_epi32(_mm512_cvttps_epi32(n), _mm512_set1_epi32(127)), 23);
  return _mm512_mul_ps(y, _mm512_castsi512_ps(e));
}
#elif defined(KVL_HALVES)
// kexp on 8 lanes (AVX2): the same operations in the same order, so a lane's bits are kexp's.
inline __m256 kexp8(__m256 x) {
  x = _mm256_max_ps(_mm256_set1_ps(-87.0f), x);
  const __m256 magic = _mm256_set1_ps(12582912.0f);
  const __m256 n = _mm256_sub_ps(_mm256_add_ps(_mm256_mul_ps(x, _mm256_set1_ps(1.44269504088896341f)), magic), magic);
  __m256 r = _mm256_sub_ps(x, _mm256_mul_ps(n, _mm256_set1_ps(0.693359375f)));
  r = _mm256_sub_ps(r, _mm256_mul_ps(n, _mm256_set1_ps(-2.12194440e-4f)));
  __m256 p = _mm256_set1_ps(1.9875691500e-4f);
  p = _mm256_add_ps(_mm256_mul_ps(p, r), _mm256_set1_ps(1.3981999507e-3f));
  p = _mm256_add_ps(_mm256_mul_ps(p, r), _mm256_set1_ps(8.3334519073e-3f));
  p = _mm256_add_ps(_mm256_mul_ps(p, r), _mm256_set1_ps(4.1665795894e-2f));
  p = _mm256_add_ps(_mm256_mul_ps(p, r), _mm256_set1_ps(1.6666665459e-1f));
  p = _mm256_add_ps(_mm256_mul_ps(p, r), _mm256_set1_ps(5.0000001201e-1f));
  const __m256 y = _mm256_add_ps(_mm256_add_ps(_mm256_mul_ps(p, _mm256_mul_ps(r, r)), r), _mm256_set1_ps(1.0f));
  const __m256i e = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvttps_epi32(n), _mm256_set1_epi32(127)), 23);
  return _mm256_mul_ps(y, _mm256_castsi256_ps(e));
}

// hsum of 8 elements' lanes at once (AVX2): s[e] = lo + hi of element e (hsum's first step);
// returns hsum(element e) in lane kHsum8Lane[e]. Each addition pairs the same two partial sums
// as hsum's tree (lanes i and i+4, i and i+2, 0 and 1); the shuffles only line them up.
constexpr int kHsum8Lane[8] = {0, 4, 1, 5, 2, 6, 3, 7};
inline __m256 hsum8(const __m256* s) {
  __m256 u[4], v[2];
  for (int k = 0; k < 4; ++k)   // 8 -> 4: [t(2k), t(2k+1)]
    u[k] = _mm256_add_ps(_mm256_permute2f128_ps(s[2 * k], s[2 * k + 1], 0x20),
                         _mm256_permute2f128_ps(s[2 * k], s[2 * k + 1], 0x31));
  for (int k = 0; k < 2; ++k)   // 4 -> 2, within each 128-bit half: [e 4k, e 4k+2 | e 4k+1, e 4k+3], 2 lanes each
    v[k] = _mm256_add_ps(_mm256_shuffle_ps(u[2 * k], u[2 * k + 1], 0x44), _mm256_shuffle_ps(u[2 * k], u[2 * k + 1], 0xEE));
  // 2 -> 1: [e0, e2, e4, e6 | e1, e3, e5, e7]
  return _mm256_add_ps(_mm256_shuffle_ps(v[0], v[1], 0x88), _mm256_shuffle_ps(v[0], v[1], 0xDD));
}
#endif

struct V4 { V v[4]; };
#if defined(__AVX512F__)
inline V vbroadcast(float x) { return {_mm512_set1_ps(x)}; }
inline void vstore(float* p, V a) { _mm512_store_ps(p, a.v); }
#elif defined(__AVX2__) && defined(__FMA__)
inline V vbroadcast(float x) { return {_mm256_set1_ps(x), _mm256_set1_ps(x)}; }
inline void vstore(float* p, V a) { _mm256_store_ps(p, a.lo); _mm256_store_ps(p + 8, a.hi); }
#else
inline V vbroadcast(float x) { V r; for (int i = 0; i < 16; ++i) r.l[i] = x; return r; }
inline void vstore(float* p, V a) { for (int i = 0; i < 16; ++i) p[i] = a.l[i]; }
#endif

// The fixed 16-lane tree of hsum, on an array.
inline float tree16(const float* l) {
  float s8[8], s4[4], s2[2];
  for (int i = 0; i < 8; ++i) s8[i] = l[i] + l[i + 8];
  for (int i = 0; i < 4; ++i) s4[i] = s8[i] + s8[i + 4];
  for (int i = 0; i < 2; ++i) s2[i] = s4[i] + s4[i + 2];
  return s2[0] + s2[1];
}

template <typename T>
inline float dot(const float* q, const T* k, int64_t D) {
  V acc = vzero();
  int64_t c = 0;
  for (; c + 16 <= D; c += 16) acc = vfma(vload(q + c), vload(k + c), acc);
  if (c < D) acc = vfma(vload_part(q + c, static_cast<int>(D - c)), vload_part(k + c, static_cast<int>(D - c)), acc);
  return hsum(acc);
}

// out[j] = dot(q, K[j]) * scale for j < n: the builds without AVX-512 or AVX2 (those score
// several heads and keys at once, scores_heads16 / scores_heads4, with these bits).
template <typename T>
inline void scores(const float* q, const T* K, int64_t stride, int64_t n, int64_t D, float scale, float* out) {
  for (int64_t j = 0; j < n; ++j) out[j] = dot(q, K + j * stride, D) * scale;
}

// p[j] <- exp(p[j] - max p) in place; returns their sum (16 lanes by j, then the lane tree).
inline float softmax(float* p, int64_t n) {
  // the max of a set, in any order (16 lanes, then across them): the same value as one by one,
  // but for the sign of a zero max, which no p[j] - m can show (x - 0 and x + 0 agree but for
  // x = -0, whose exp is 1 either way). A NaN score makes the whole row NaN either way.
  float m = p[0];
  int64_t j = 1;
#if defined(KVL_HSUM16)
  if (n >= 16) {
    __m512 vmax = _mm512_loadu_ps(p);
    for (j = 16; j + 16 <= n; j += 16) vmax = _mm512_max_ps(vmax, _mm512_loadu_ps(p + j));
    m = _mm512_reduce_max_ps(vmax);
  }
#elif defined(KVL_HALVES)
  if (n >= 8) {
    __m256 vmax = _mm256_loadu_ps(p);
    for (j = 8; j + 8 <= n; j += 8) vmax = _mm256_max_ps(vmax, _mm256_loadu_ps(p + j));
    alignas(32) float l8[8];
    _mm256_store_ps(l8, vmax);
    m = l8[0];
    for (int i = 1; i < 8; ++i) m = l8[i] > m ? l8[i] : m;
  }
#endif
  for (; j < n; ++j) m = p[j] > m ? p[j] : m;
  float lanes[16] = {};
  j = 0;
#if defined(KVL_HSUM16)
  const __m512 vm = _mm512_set1_ps(m);
  __m512 vl = _mm512_setzero_ps();
  for (; j + 16 <= n; j += 16) {
    const __m512 e = kexp16(_mm512_sub_ps(_mm512_loadu_ps(p + j), vm));
    _mm512_storeu_ps(p + j, e);
    vl = _mm512_add_ps(vl, e);
  }
  _mm512_storeu_ps(lanes, vl);
#elif defined(KVL_HALVES)
  const __m256 vm = _mm256_set1_ps(m);
  __m256 vlo = _mm256_setzero_ps(), vhi = _mm256_setzero_ps();
  for (; j + 16 <= n; j += 16) {
    const __m256 e0 = kexp8(_mm256_sub_ps(_mm256_loadu_ps(p + j), vm));
    const __m256 e1 = kexp8(_mm256_sub_ps(_mm256_loadu_ps(p + j + 8), vm));
    _mm256_storeu_ps(p + j, e0);
    _mm256_storeu_ps(p + j + 8, e1);
    vlo = _mm256_add_ps(vlo, e0);
    vhi = _mm256_add_ps(vhi, e1);
  }
  _mm256_storeu_ps(lanes, vlo);
  _mm256_storeu_ps(lanes + 8, vhi);
#endif
  for (int64_t j0 = j; j < n; ++j) {
    p[j] = kexp(p[j] - m);
    lanes[(j - j0) & 15] += p[j];     // j0 is a multiple of 16 from 0 (or 0): lane = j mod 16
  }
  return tree16(lanes);
}

// p * v over keys [j0, j1) for one row, 64 output elements (4 whole chunks) at vals: the
// accumulators stay in registers (with a run-time chunk count the compiler kept them on the
// stack, and every FMA waited for a store and a load). The same operations, in the same order,
// as the general loop of attend_tile.
template <typename T>
inline void pv_row64(const float* p, const T* vals, int64_t stride, int64_t j0, int64_t j1, V* acc) {
  V a0 = acc[0], a1 = acc[1], a2 = acc[2], a3 = acc[3];
  for (int64_t j = j0; j < j1; ++j) {
    const T* vj = vals + j * stride;
    const V pj = vbroadcast(p[j]);
    a0 = vfma(pj, vload(vj), a0);
    a1 = vfma(pj, vload(vj + 16), a1);
    a2 = vfma(pj, vload(vj + 32), a2);
    a3 = vfma(pj, vload(vj + 48), a3);
  }
  acc[0] = a0; acc[1] = a1; acc[2] = a2; acc[3] = a3;
}

// The keys [j0, j1) every one of R rows reads: each key's 4 chunks loaded once for all of them.
template <typename T, int R>
inline void pv_rows64(const float* const* p, const T* vals, int64_t stride, int64_t j0, int64_t j1, V (*acc)[4]) {
  V a[R][4];
  for (int i = 0; i < R; ++i)
    for (int c = 0; c < 4; ++c) a[i][c] = acc[i][c];
  for (int64_t j = j0; j < j1; ++j) {
    const T* vj = vals + j * stride;
    // loaded once, not folded into each row's FMA (see pin); scalars, not an array, or GCC
    // stores the array to the stack for the asm every key
    V v0 = vload(vj), v1 = vload(vj + 16), v2 = vload(vj + 32), v3 = vload(vj + 48);
    if constexpr (R > 1) {
      pin(v0);
      pin(v1);
      pin(v2);
      pin(v3);
    }
    const V vc[4] = {v0, v1, v2, v3};
    for (int i = 0; i < R; ++i) {
      const V pj = vbroadcast(p[i][j]);
      for (int c = 0; c < 4; ++c) a[i][c] = vfma(pj, vc[c], a[i][c]);
    }
  }
  for (int i = 0; i < R; ++i)
    for (int c = 0; c < 4; ++c) acc[i][c] = a[i][c];
}
// acc[d] = sum over j in order of p[j] * vals[j][d] (one multiply-add per element and key: FMA with
// AVX-512/AVX2, a multiply then an add otherwise — the same for every element of a machine).
// (Elements from d_from on; carry: the sums go on from acc's values, the keys before these —
// an earlier key run of a paged segment — having been summed into it in order.)
template <typename T>
inline void weighted_sum(const float* p, const T* vals, int64_t stride, int64_t n, int64_t D, float* acc,
                         int64_t d_from = 0, bool carry = false) {
  for (int64_t d0 = d_from; d0 < D; d0 += 64) {
    if (D - d0 >= 64) {                 // 4 whole chunks: in registers (pv_row64)
      V r[4] = {vzero(), vzero(), vzero(), vzero()};
      if (carry)
        for (int c = 0; c < 4; ++c) r[c] = vload(acc + d0 + 16 * c);
      pv_row64(p, vals + d0, stride, 0, n, r);
      for (int c = 0; c < 4; ++c) {
        alignas(64) float tmp[16];
        vstore(tmp, r[c]);
        for (int l = 0; l < 16; ++l) acc[d0 + 16 * c + l] = tmp[l];
      }
      continue;
    }
    const int chunks = static_cast<int>(std::min<int64_t>(4, (D - d0 + 15) / 16));
    V4 a;
    for (int c = 0; c < 4; ++c) {
      const int64_t left = D - d0 - 16 * c;
      a.v[c] = !carry || left <= 0 ? vzero()
               : left >= 16 ? vload(acc + d0 + 16 * c) : vload_part(acc + d0 + 16 * c, static_cast<int>(left));
    }
    for (int64_t j = 0; j < n; ++j) {
      const T* vj = vals + j * stride + d0;
      const V pj = vbroadcast(p[j]);
      for (int c = 0; c < chunks; ++c) {
        const int64_t left = D - d0 - 16 * c;
        a.v[c] = vfma(pj, left >= 16 ? vload(vj + 16 * c) : vload_part(vj + 16 * c, static_cast<int>(left)), a.v[c]);
      }
    }
    for (int c = 0; c < chunks; ++c) {
      alignas(64) float tmp[16];
      vstore(tmp, a.v[c]);
      const int64_t left = std::min<int64_t>(16, D - d0 - 16 * c);
      for (int64_t l = 0; l < left; ++l) acc[d0 + 16 * c + l] = tmp[l];
    }
  }
}

#if defined(KVL_HALVES)
// AVX2: G (<= 3) heads of one kv head over 32 elements at once: 12 independent FMA chains
// (one head over 64 elements had 8, each waiting 4 cycles on the one before), each key's V chunk
// loaded once for the G heads. Per element the same FMA over the keys in order. The keys lie in
// runs (vals[r]: lens[r] keys, p's columns in the same order; one run for a buffer, a block's per
// run where they are read in place): the chains stay in registers from run to run (a call per
// 16-key block, storing and reloading them, cost ~20 % of a decode's attention).
template <typename T, int G>
inline void pv_heads32(const float* p, int64_t ldp, const T* const* vals, const int64_t* lens, int64_t runs,
                       int64_t d0, int64_t stride, float* acc, int64_t D) {
  __m256 a[G][4];
  for (int h = 0; h < G; ++h)
    for (int c = 0; c < 4; ++c) a[h][c] = _mm256_setzero_ps();
  for (int64_t r = 0; r < runs; ++r, p += lens[r - 1]) {
    const T* base = vals[r] + d0;
    if (r + 1 < runs)   // the next run's first rows, while this one is read (see attend_item's ahead)
      for (int64_t j = 0; j < std::min<int64_t>(8, lens[r + 1]); ++j)
        for (int64_t b = 0; b < 32 * static_cast<int64_t>(sizeof(T)); b += 64)
          __builtin_prefetch(reinterpret_cast<const char*>(vals[r + 1] + d0 + j * stride) + b);
    for (int64_t j = 0; j < lens[r]; ++j) {
      const T* vj = base + j * stride;
      __m256 b[G];
      for (int h = 0; h < G; ++h) b[h] = _mm256_set1_ps(p[h * ldp + j]);
      for (int c = 0; c < 4; ++c) {
        __m256 v = load8(vj + 8 * c);
        if constexpr (G > 1) pin8(v);
        for (int h = 0; h < G; ++h) a[h][c] = _mm256_fmadd_ps(b[h], v, a[h][c]);
      }
    }
  }
  for (int h = 0; h < G; ++h)
    for (int c = 0; c < 4; ++c) _mm256_storeu_ps(acc + h * D + 8 * c, a[h][c]);
}
#endif

#if defined(KVL_HALVES)
// AVX2: G (<= 3) heads of one kv head score 4 keys at once: each key's chunk loaded once for the
// G heads, 12 chains. Every element by dot's lane code (the product's two half passes, then
// hsum8, which pairs lanes as hsum does). The
// K rows 8 keys ahead are prefetched: a decode row's keys come from memory (32 rows at 800 keys,
// Zen 3: 2.4 -> 2.0 ms per layer float32, 1.5 -> 1.2 bfloat16).
template <typename T, int G>
inline void scores_heads4(const float* q, const T* K, int64_t stride, int64_t n, int64_t D, float scale, float* sc,
                          int64_t ldsc) {
  const __m256 vs = _mm256_set1_ps(scale);
  int64_t j = 0;
  for (; j + 4 <= n; j += 4) {
    if (j + 12 <= n)
      for (int key = 8; key < 12; ++key)
        for (int64_t b = 0; b < D * static_cast<int64_t>(sizeof(T)); b += 64)
          _mm_prefetch(reinterpret_cast<const char*>(K + (j + key) * stride) + b, _MM_HINT_T0);
    alignas(32) float lo[G * 4][8];
    __m256 acc[G][4];
    for (int hf = 0; hf < 2; ++hf) {
      for (int h = 0; h < G; ++h)
        for (int key = 0; key < 4; ++key) acc[h][key] = _mm256_setzero_ps();
      int64_t c = 0;
      for (; c + 16 <= D; c += 16) {
        __m256 qv[G];
        for (int h = 0; h < G; ++h) {
          qv[h] = _mm256_loadu_ps(q + h * D + c + 8 * hf);
          pin8(qv[h]);
        }
        for (int key = 0; key < 4; ++key) {
          __m256 kv = load8(K + (j + key) * stride + c + 8 * hf);
          if constexpr (G > 1) pin8(kv);
          for (int h = 0; h < G; ++h) acc[h][key] = _mm256_fmadd_ps(qv[h], kv, acc[h][key]);
        }
      }
      if (c < D) {
        const int rest = static_cast<int>(D - c);
        for (int key = 0; key < 4; ++key) {
          const V kp = vload_part(K + (j + key) * stride + c, rest);
          for (int h = 0; h < G; ++h) {
            const V qp = vload_part(q + h * D + c, rest);
            acc[h][key] = _mm256_fmadd_ps(hf ? qp.hi : qp.lo, hf ? kp.hi : kp.lo, acc[h][key]);
          }
        }
      }
      if (hf == 0)
        for (int h = 0; h < G; ++h)
          for (int key = 0; key < 4; ++key) _mm256_store_ps(lo[4 * h + key], acc[h][key]);
    }
    __m256 s8[16];
    for (int h = 0; h < G; ++h)
      for (int key = 0; key < 4; ++key) s8[4 * h + key] = _mm256_add_ps(_mm256_load_ps(lo[4 * h + key]), acc[h][key]);
    for (int e = 4 * G; e < 16; ++e) s8[e] = _mm256_setzero_ps();
    alignas(32) float r[16];
    _mm256_store_ps(r, _mm256_mul_ps(hsum8(s8), vs));
    if constexpr (G > 2) _mm256_store_ps(r + 8, _mm256_mul_ps(hsum8(s8 + 8), vs));
    for (int e = 0; e < 4 * G; ++e) sc[(e / 4) * ldsc + j + e % 4] = r[8 * (e / 8) + kHsum8Lane[e % 8]];
  }
  for (; j < n; ++j)
    for (int h = 0; h < G; ++h) sc[h * ldsc + j] = dot(q + h * D, K + j * stride, D) * scale;
}
#endif

#if defined(KVL_HSUM16)
// AVX-512: G (<= 4) heads of one kv head score 4 keys at once, each key's chunk loaded once for
// the G heads (4G independent chains), the 4G elements' lanes summed by one hsum16, which pairs
// them as hsum does: every (key, head) gets scores()'s bits. K rows 8 keys ahead are prefetched:
// a decode row's keys come from memory.
template <typename T, int G>
inline void scores_heads16(const float* q, const T* K, int64_t stride, int64_t n, int64_t D, float scale, float* sc,
                           int64_t ldsc) {
  const __m512 vs = _mm512_set1_ps(scale);
  int64_t j = 0;
  for (; j + 4 <= n; j += 4) {
    if (j + 12 <= n)
      for (int key = 8; key < 12; ++key)
        for (int64_t b = 0; b < D * static_cast<int64_t>(sizeof(T)); b += 64)
          _mm_prefetch(reinterpret_cast<const char*>(K + (j + key) * stride) + b, _MM_HINT_T0);
    __m512 acc[16];
    for (int e = 0; e < 16; ++e) acc[e] = _mm512_setzero_ps();
    int64_t c = 0;
    for (; c + 16 <= D; c += 16) {
      V qv[G];
      for (int h = 0; h < G; ++h) {
        qv[h] = vload(q + h * D + c);
        pin(qv[h]);
      }
      for (int key = 0; key < 4; ++key) {
        V kv = vload(K + (j + key) * stride + c);
        if constexpr (G > 1) pin(kv);
        for (int h = 0; h < G; ++h) acc[4 * h + key] = vfma(qv[h], kv, V{acc[4 * h + key]}).v;
      }
    }
    if (c < D) {
      const int rest = static_cast<int>(D - c);
      for (int key = 0; key < 4; ++key) {
        const V kp = vload_part(K + (j + key) * stride + c, rest);
        for (int h = 0; h < G; ++h) acc[4 * h + key] = vfma(vload_part(q + h * D + c, rest), kp, V{acc[4 * h + key]}).v;
      }
    }
    alignas(64) float r[16];
    _mm512_store_ps(r, _mm512_mul_ps(hsum16(acc), vs));
    for (int e = 0; e < 4 * G; ++e) sc[(e / 4) * ldsc + j + e % 4] = r[4 * (e % 4) + e / 4];   // out[4l + q] <- a[4q + l]
  }
  for (; j < n; ++j)
    for (int h = 0; h < G; ++h) sc[h * ldsc + j] = dot(q + h * D, K + j * stride, D) * scale;
}

// AVX-512: G (<= 4) heads of one kv head over 64 elements at once: pv_rows64 with the heads as
// its rows (each key's V chunks loaded once for the G heads, 4G chains where one head had 4).
template <typename T, int G>
inline void pv_heads64(const float* p, int64_t ldp, int64_t n, const T* vals, int64_t stride, float* acc, int64_t D,
                       bool carry) {
  const float* ph[G];
  V a[G][4];
  for (int h = 0; h < G; ++h) {
    ph[h] = p + h * ldp;
    for (int c = 0; c < 4; ++c) a[h][c] = carry ? vload(acc + h * D + 16 * c) : vzero();
  }
  pv_rows64<T, G>(ph, vals, stride, 0, n, a);
  for (int h = 0; h < G; ++h)
    for (int c = 0; c < 4; ++c) _mm512_storeu_ps(acc + h * D + 16 * c, a[h][c].v);
}
#endif

// scores for g heads (q [g][D]) over n keys into sc [g][n].
template <typename T>
inline void scores_heads(const float* q, int64_t g, const T* K, int64_t stride, int64_t n, int64_t D, float scale,
                         float* sc, int64_t ldsc) {
#if defined(KVL_HALVES)
  for (int64_t h0 = 0; h0 < g; h0 += 3)
    switch (std::min<int64_t>(3, g - h0)) {
      case 1: scores_heads4<T, 1>(q + h0 * D, K, stride, n, D, scale, sc + h0 * ldsc, ldsc); break;
      case 2: scores_heads4<T, 2>(q + h0 * D, K, stride, n, D, scale, sc + h0 * ldsc, ldsc); break;
      default: scores_heads4<T, 3>(q + h0 * D, K, stride, n, D, scale, sc + h0 * ldsc, ldsc); break;
    }
#elif defined(KVL_HSUM16)
  for (int64_t h0 = 0; h0 < g; h0 += 4)
    switch (std::min<int64_t>(4, g - h0)) {
      case 1: scores_heads16<T, 1>(q + h0 * D, K, stride, n, D, scale, sc + h0 * ldsc, ldsc); break;
      case 2: scores_heads16<T, 2>(q + h0 * D, K, stride, n, D, scale, sc + h0 * ldsc, ldsc); break;
      case 3: scores_heads16<T, 3>(q + h0 * D, K, stride, n, D, scale, sc + h0 * ldsc, ldsc); break;
      default: scores_heads16<T, 4>(q + h0 * D, K, stride, n, D, scale, sc + h0 * ldsc, ldsc); break;
    }
#else
  for (int64_t hh = 0; hh < g; ++hh) scores(q + hh * D, K, stride, n, D, scale, sc + hh * ldsc);
#endif
}

// weighted_sum for g heads (p [g][ldp]) into acc [g][D], over the keys of `runs` runs in order: run r's
// lens[r] keys at vals[r] (rows `stride` apart), their p the next lens[r] columns.
template <typename T>
inline void weighted_sums(const float* p, int64_t ldp, int64_t g, const T* const* vals, const int64_t* lens,
                          int64_t runs, int64_t stride, int64_t D, float* acc) {
  int64_t from = 0;
#if defined(KVL_HALVES)
  from = D / 32 * 32;
  for (int64_t d0 = 0; d0 < from; d0 += 32)
    for (int64_t h0 = 0; h0 < g; h0 += 3) {
      const float* ph = p + h0 * ldp;
      float* out = acc + h0 * D + d0;
      switch (std::min<int64_t>(3, g - h0)) {
        case 1: pv_heads32<T, 1>(ph, ldp, vals, lens, runs, d0, stride, out, D); break;
        case 2: pv_heads32<T, 2>(ph, ldp, vals, lens, runs, d0, stride, out, D); break;
        default: pv_heads32<T, 3>(ph, ldp, vals, lens, runs, d0, stride, out, D); break;
      }
    }
#elif defined(KVL_HSUM16)
  from = D / 64 * 64;
  for (int64_t d0 = 0; d0 < from; d0 += 64)
    for (int64_t h0 = 0; h0 < g; h0 += 4) {
      float* out = acc + h0 * D + d0;
      const float* ph = p + h0 * ldp;
      for (int64_t r = 0; r < runs; ph += lens[r], ++r) {   // the sums carried through acc from run to run
        switch (std::min<int64_t>(4, g - h0)) {
          case 1: pv_heads64<T, 1>(ph, ldp, lens[r], vals[r] + d0, stride, out, D, r > 0); break;
          case 2: pv_heads64<T, 2>(ph, ldp, lens[r], vals[r] + d0, stride, out, D, r > 0); break;
          case 3: pv_heads64<T, 3>(ph, ldp, lens[r], vals[r] + d0, stride, out, D, r > 0); break;
          default: pv_heads64<T, 4>(ph, ldp, lens[r], vals[r] + d0, stride, out, D, r > 0); break;
        }
      }
    }
#endif
  if (from < D)
    for (int64_t hh = 0; hh < g; ++hh) {
      const float* ph = p + hh * ldp;
      for (int64_t r = 0; r < runs; ph += lens[r], ++r)
        weighted_sum(ph, vals[r], stride, lens[r], D, acc + hh * D, from, r > 0);
    }
}

#if defined(KVL_AMX)
// Scores through AMX tiles, where bfloat16 products take them (cpu_linear.cpp's g_amx) and q and K
// are bfloat16: sc[r * ldsc + j] = (q[r] . K[j], one float32 chain over d's pairs in order, as
// TDPBF16PS accumulates) * scale, for rows r < R and keys j < n. K is the A operand read where it
// lies (16 keys x 32 elements, the buffer's row stride); the rows of q (bfloat16 values widened,
// so their top halves are exact) are packed as B's columns. A (row, head)'s score reads its own q
// and key only, so a decode step and a prefill tile give it the same bits whatever shares the
// tiles; they are other bits than the vector path's lane sums (attention_path names the build).
// The keys past the last whole tile, and every tile when D is not whole 32-element chunks, go
// through a zero-filled copy (+0 products).
void amx_scores(const float* q, int64_t R, const bf16* K, int64_t stride, int64_t n, int64_t D, float scale,
                float* sc, int64_t ldsc, bool prefetch) {
  const int64_t chunks = (D + 31) / 32;
  const bool whole = D % 32 == 0;
  const int64_t lda = stride * static_cast<int64_t>(sizeof(bf16));
  configure_tiles();
  thread_local std::vector<uint32_t> bq;
  alignas(64) float c[2][256];
  alignas(64) bf16 pad[16 * 32];
  const __m512i col = column_offsets();
  const __m512 vs = _mm512_set1_ps(scale);
  for (int64_t r0 = 0; r0 < R; r0 += 16) {
    const int64_t rows = std::min<int64_t>(16, R - r0);
    bq.assign(static_cast<size_t>(chunks * 256), 0);
    for (int64_t r = 0; r < rows; ++r)
      for (int64_t d = 0; d < D; ++d) {
        uint32_t bits;
        std::memcpy(&bits, q + (r0 + r) * D + d, 4);
        bq[static_cast<size_t>(((d / 32) * 16 + (d % 32) / 2) * 16 + r)] |= (bits >> 16) << (16 * (d & 1));
      }
    // C tile (keys i, rows r) -> sc[r][j0 + i] * scale, its first `keys` keys
    auto put = [&](const float* ct, int64_t j0, int64_t keys) {
      const __mmask16 m = static_cast<__mmask16>((1u << keys) - 1);
      for (int64_t r = 0; r < rows; ++r)
        _mm512_mask_storeu_ps(sc + (r0 + r) * ldsc + j0, m, _mm512_mul_ps(_mm512_i32gather_ps(col, ct + r, 4), vs));
    };
    int64_t j0 = 0;
    if (whole) {
      for (; j0 + 32 <= n; j0 += 32) {   // two key tiles in flight
        // a decode row's keys come from memory: the next two tiles' K rows ahead (a decode step
        // 4 % faster at 32 rows x 896 keys); a prompt tile's are in cache, read by the tiles before
        if (prefetch)
          for (int64_t j = j0 + 32; j < std::min<int64_t>(n, j0 + 64); ++j)
            for (int64_t d = 0; d < D; d += 32) _mm_prefetch(reinterpret_cast<const char*>(K + j * stride + d), _MM_HINT_T0);
        _tile_zero(0);
        _tile_zero(1);
        for (int64_t kc = 0; kc < chunks; ++kc) {
          _tile_loadd(6, bq.data() + kc * 256, 64);
          _tile_loadd(4, K + j0 * stride + kc * 32, lda);
          _tile_loadd(5, K + (j0 + 16) * stride + kc * 32, lda);
          _tile_dpbf16ps(0, 4, 6);
          _tile_dpbf16ps(1, 5, 6);
        }
        _tile_stored(0, c[0], 64);
        _tile_stored(1, c[1], 64);
        put(c[0], j0, 16);
        put(c[1], j0 + 16, 16);
      }
      for (; j0 + 16 <= n; j0 += 16) {
        _tile_zero(0);
        for (int64_t kc = 0; kc < chunks; ++kc) {
          _tile_loadd(6, bq.data() + kc * 256, 64);
          _tile_loadd(4, K + j0 * stride + kc * 32, lda);
          _tile_dpbf16ps(0, 4, 6);
        }
        _tile_stored(0, c[0], 64);
        put(c[0], j0, 16);
      }
    }
    for (; j0 < n; j0 += 16) {
      const int64_t keys = std::min<int64_t>(16, n - j0);
      _tile_zero(0);
      for (int64_t kc = 0; kc < chunks; ++kc) {
        const int64_t e = std::min<int64_t>(32, D - kc * 32);
        std::fill(pad, pad + 16 * 32, bf16(0.0f));
        for (int64_t i = 0; i < keys; ++i) std::copy(K + (j0 + i) * stride + kc * 32, K + (j0 + i) * stride + kc * 32 + e, pad + i * 32);
        _tile_loadd(6, bq.data() + kc * 256, 64);
        _tile_loadd(4, pad, 64);
        _tile_dpbf16ps(0, 4, 6);
      }
      _tile_stored(0, c[0], 64);
      put(c[0], j0, keys);
    }
  }
  _tile_release();
}
#endif

// The scores of R rows of q ([R][D], widened) over n keys through AMX where that is this build's
// and this process's bfloat16 arithmetic (see amx_scores); false: the caller's vector path.
template <typename TQ, typename T>
inline bool amx_scores_for(const float* q, int64_t R, const T* K, int64_t stride, int64_t n, int64_t D, float scale,
                           float* sc, int64_t ldsc, bool prefetch) {
#if defined(KVL_AMX)
  if constexpr (std::is_same<TQ, bf16>::value && std::is_same<T, bf16>::value) {
    if (g_amx) {
      amx_scores(q, R, K, stride, n, D, scale, sc, ldsc, prefetch);
      return true;
    }
  }
#endif
  return false;
}

inline float widen(float v) { return v; }
inline float widen(bf16 v) { return static_cast<float>(v); }

// A run of a paged segment's keys: positions lo .. lo + len - 1, consecutive in memory.
struct Run {
  const void* k;
  const void* v;
  int64_t lo, len;
};

struct Segment {
  const void* k;
  const void* v;
  int64_t stride;   // elements between consecutive positions
  int64_t lo, len;  // absolute position of row 0, rows held
  // Paged (non-empty): the keys lie in these runs, in order, covering lo .. lo + len - 1 (k and v
  // unused): the blocks of a cached prefix read in place from the cache's pool slots, then the
  // request's own buffer. A key's score and its term of the weighted sum are the contiguous
  // layout's (per key, the same instructions; the sums carried from run to run in key order).
  std::vector<Run> runs;
};

// One work item: query row r, kv head kh, its g query heads. out: [H, D] of row r.
template <typename TQ, typename T>
void attend_item(const TQ* qrow, const Segment& s, int64_t t, int64_t window, int64_t kh, int64_t g,
                 int64_t D, float scale, float* out) {
  const int64_t a = window > 0 ? std::max<int64_t>(0, t - window + 1) : 0;
  const int64_t n = t - a + 1;
  thread_local std::vector<float> buf;
  buf.resize(static_cast<size_t>(g * (n + D) + g * D));
  float* qf = buf.data();                 // [g, D] widened queries
  float* acc = qf + g * D;                // [g, D]
  float* sc = acc + g * D;                // [g, n] scores, then p
  thread_local std::vector<float> denom;
  denom.resize(static_cast<size_t>(g));
  for (int64_t hh = 0; hh < g; ++hh)
    for (int64_t d = 0; d < D; ++d) qf[hh * D + d] = widen(qrow[(kh * g + hh) * D + d]);
  if (s.runs.empty()) {
    const T* K = static_cast<const T*>(s.k) + (a - s.lo) * s.stride + kh * D;
    const T* Vv = static_cast<const T*>(s.v) + (a - s.lo) * s.stride + kh * D;
    if (!amx_scores_for<TQ, T>(qf, g, K, s.stride, n, D, scale, sc, n, true)) scores_heads(qf, g, K, s.stride, n, D, scale, sc, n);
    for (int64_t hh = 0; hh < g; ++hh) denom[hh] = softmax(sc + hh * n, n);
    weighted_sums(sc, n, g, &Vv, &n, 1, s.stride, D, acc);
  } else {
    // each run's part of the keys a .. t: its scores into their columns, then (after the one
    // softmax over all of them) its terms added to the sums in key order
    // f(run, its first key, one past its last, the next run's first key or -1), for each run in order
    auto each = [&](auto f) {
      const int64_t m = static_cast<int64_t>(s.runs.size());
      for (int64_t i = 0; i < m; ++i) {
        const Run& r = s.runs[i];
        const int64_t j0 = std::max(a, r.lo), j1 = std::min(t + 1, r.lo + r.len);
        if (j0 < j1) f(r, j0, j1, i + 1 < m && j1 <= t ? i + 1 : -1);
      }
    };
    // a run is a few KB somewhere else: the hardware's stream prefetch starts over at each, so the
    // next run's first rows are asked for while this one is read (a decode at 1,008 keys in pool
    // slots of 16, against one buffer, Zen 2: 1.15-1.25x with, 1.2-1.35x without; a noisy host)
    auto ahead = [&](const void* base, int64_t next) {
      if (next < 0) return;
      const Run& r = s.runs[next];
      const char* p = static_cast<const char*>(base) + kh * D * static_cast<int64_t>(sizeof(T));
      for (int64_t j = 0; j < std::min<int64_t>(8, r.len); ++j)
        for (int64_t b = 0; b < D * static_cast<int64_t>(sizeof(T)); b += 64)
          __builtin_prefetch(p + j * s.stride * static_cast<int64_t>(sizeof(T)) + b);
    };
    each([&](const Run& r, int64_t j0, int64_t j1, int64_t next) {
      if (next >= 0) ahead(s.runs[next].k, next);
      const T* K = static_cast<const T*>(r.k) + (j0 - r.lo) * s.stride + kh * D;
      if (!amx_scores_for<TQ, T>(qf, g, K, s.stride, j1 - j0, D, scale, sc + (j0 - a), n, true))
        scores_heads(qf, g, K, s.stride, j1 - j0, D, scale, sc + (j0 - a), n);
    });
    for (int64_t hh = 0; hh < g; ++hh) denom[hh] = softmax(sc + hh * n, n);
    thread_local std::vector<const T*> vals;
    thread_local std::vector<int64_t> lens;
    vals.clear();
    lens.clear();
    each([&](const Run& r, int64_t j0, int64_t j1, int64_t) {
      vals.push_back(static_cast<const T*>(r.v) + (j0 - r.lo) * s.stride + kh * D);
      lens.push_back(j1 - j0);
    });
    weighted_sums(sc, n, g, vals.data(), lens.data(), static_cast<int64_t>(vals.size()), s.stride, D, acc);
  }
  for (int64_t hh = 0; hh < g; ++hh) {
    float* dst = out + (kh * g + hh) * D;
    for (int64_t d = 0; d < D; ++d) dst[d] = acc[hh * D + d] / denom[hh];
  }
}

#if defined(KVL_HSUM16)
// Up to 4 query rows of one segment and one kv head at once: the same per-(row, head) arithmetic
// as attend_item (scores by dot's lane code: 4 keys x 4 rows share one hsum16, which pairs lanes
// as hsum does; each row's softmax over its own keys, anchored at its first; p * v summed over its
// keys in order), with each key's K and V chunks loaded once for all the rows. A row's keys
// a_i .. t_i are walked as [a_i, A), then [A, T] with the others (A, T: the latest first key and
// the earliest last key of the tile), then (T, t_i]: its own order, whichever rows share a tile.
template <typename TQ, typename T>
void attend_tile(const TQ* const* qrows, int R, const Segment& s, const int64_t* t, int64_t window, int64_t kh,
                 int64_t g, int64_t D, float scale, float* const* outs) {
  int64_t a[4], lo = INT64_MAX, hi = -1, A = -1, Tm = INT64_MAX;
  for (int i = 0; i < R; ++i) {
    a[i] = window > 0 ? std::max<int64_t>(0, t[i] - window + 1) : 0;
    lo = std::min(lo, a[i]);
    hi = std::max(hi, t[i]);
    A = std::max(A, a[i]);
    Tm = std::min(Tm, t[i]);
  }
  const int64_t n = hi - lo + 1;
  thread_local std::vector<float> buf;
  buf.resize(static_cast<size_t>(4 * g * (n + D) + 16));
  float* qf = buf.data();               // [4][g][D]
  float* sc = qf + 4 * g * D;           // [4][g][n] scores over lo .. hi
  for (int i = 0; i < 4; ++i)           // rows past R repeat row 0 (computed, never read)
    for (int64_t hh = 0; hh < g; ++hh)
      for (int64_t d = 0; d < D; ++d) qf[(i * g + hh) * D + d] = widen(qrows[i < R ? i : 0][(kh * g + hh) * D + d]);
  const T* K = static_cast<const T*>(s.k) + (lo - s.lo) * s.stride + kh * D;
  const T* Vv = static_cast<const T*>(s.v) + (lo - s.lo) * s.stride + kh * D;
  const __m512 vs = _mm512_set1_ps(scale);
  const bool amx = amx_scores_for<TQ, T>(qf, 4 * g, K, s.stride, n, D, scale, sc, n, false);   // every row and head at once
  for (int64_t hh = 0; hh < g; ++hh) {
    int64_t j = amx ? n : 0;
    for (; j + 4 <= n; j += 4) {
      __m512 acc[16];
      for (int e = 0; e < 16; ++e) acc[e] = _mm512_setzero_ps();
      for (int64_t c = 0; c < D; c += 16) {
        const int rest = static_cast<int>(std::min<int64_t>(16, D - c));
        V kc[4];
        for (int key = 0; key < 4; ++key) {
          kc[key] = rest == 16 ? vload(K + (j + key) * s.stride + c) : vload_part(K + (j + key) * s.stride + c, rest);
          pin(kc[key]);                  // each key's chunk loaded once for the 4 rows (see pin)
        }
        for (int i = 0; i < 4; ++i) {
          const float* qi = qf + (i * g + hh) * D + c;
          V qc = rest == 16 ? vload(qi) : vload_part(qi, rest);
          pin(qc);
          for (int key = 0; key < 4; ++key) acc[4 * i + key] = vfma(qc, kc[key], V{acc[4 * i + key]}).v;
        }
      }
      alignas(64) float r[16];
      _mm512_store_ps(r, _mm512_mul_ps(hsum16(acc), vs));
      for (int i = 0; i < R; ++i)
        for (int key = 0; key < 4; ++key) sc[(i * g + hh) * n + j + key] = r[4 * key + i];   // out[4l + q] <- a[4q + l]
    }
    for (; j < n; ++j)
      for (int i = 0; i < R; ++i) sc[(i * g + hh) * n + j] = dot(qf + (i * g + hh) * D, K + j * s.stride, D) * scale;
    float denom[4];
    for (int i = 0; i < R; ++i) denom[i] = softmax(sc + (i * g + hh) * n + (a[i] - lo), t[i] - a[i] + 1);
    for (int64_t d0 = 0; d0 < D; d0 += 64) {
      const int chunks = static_cast<int>(std::min<int64_t>(4, (D - d0 + 15) / 16));
      V acc[4][4];
      for (int i = 0; i < 4; ++i)
        for (int c = 0; c < 4; ++c) acc[i][c] = vzero();
      auto one = [&](int i, int64_t j0, int64_t j1) {      // row i alone, keys j0 .. j1 - 1 (absolute)
        for (int64_t j = j0; j < j1; ++j) {
          const T* vj = Vv + (j - lo) * s.stride + d0;
          const V pj = vbroadcast(sc[(i * g + hh) * n + (j - lo)]);
          for (int c = 0; c < chunks; ++c) {
            const int64_t left = D - d0 - 16 * c;
            acc[i][c] = vfma(pj, left >= 16 ? vload(vj + 16 * c) : vload_part(vj + 16 * c, static_cast<int>(left)), acc[i][c]);
          }
        }
      };
      const bool common = A <= Tm;
      if (chunks == 4 && D - d0 >= 64) {   // whole chunks (D = 64, 128, ...): registers, see pv_row64
        // keys by their offset from lo: key j's chunk at vals + (j - lo) * stride, its p at p[i][j - lo]
        const T* vals = Vv + d0;
        const float* p[4];
        for (int i = 0; i < R; ++i) p[i] = sc + (i * g + hh) * n;
        for (int i = 0; i < R; ++i) pv_row64(p[i], vals, s.stride, a[i] - lo, (common ? A : t[i] + 1) - lo, acc[i]);
        if (common) {
          switch (R) {
            case 1: pv_rows64<T, 1>(p, vals, s.stride, A - lo, Tm + 1 - lo, acc); break;
            case 2: pv_rows64<T, 2>(p, vals, s.stride, A - lo, Tm + 1 - lo, acc); break;
            case 3: pv_rows64<T, 3>(p, vals, s.stride, A - lo, Tm + 1 - lo, acc); break;
            default: pv_rows64<T, 4>(p, vals, s.stride, A - lo, Tm + 1 - lo, acc); break;
          }
          for (int i = 0; i < R; ++i) pv_row64(p[i], vals, s.stride, Tm + 1 - lo, t[i] + 1 - lo, acc[i]);
        }
      } else {
      for (int i = 0; i < R; ++i) one(i, a[i], common ? A : t[i] + 1);
      if (common) {
        for (int64_t j = A; j <= Tm; ++j) {
          const T* vj = Vv + (j - lo) * s.stride + d0;
          V vc[4];
          for (int c = 0; c < chunks; ++c) {
            const int64_t left = D - d0 - 16 * c;
            vc[c] = left >= 16 ? vload(vj + 16 * c) : vload_part(vj + 16 * c, static_cast<int>(left));
          }
          for (int i = 0; i < R; ++i) {
            const V pj = vbroadcast(sc[(i * g + hh) * n + (j - lo)]);
            for (int c = 0; c < chunks; ++c) acc[i][c] = vfma(pj, vc[c], acc[i][c]);
          }
        }
        for (int i = 0; i < R; ++i) one(i, Tm + 1, t[i] + 1);
      }
      }
      for (int i = 0; i < R; ++i) {
        float* dst = outs[i] + (kh * g + hh) * D;
        for (int c = 0; c < chunks; ++c) {
          alignas(64) float tmp[16];
          vstore(tmp, acc[i][c]);
          const int64_t left = std::min<int64_t>(16, D - d0 - 16 * c);
          for (int64_t l = 0; l < left; ++l) dst[d0 + 16 * c + l] = tmp[l] / denom[i];
        }
      }
    }
  }
}
#endif

}  // namespace

namespace {

// attention's arithmetic over segments already resolved to where their K/V lie (q contiguous,
// pos contiguous int64; every query's keys checked to lie in its segment by the caller).
torch::Tensor attend_segments(const torch::Tensor& q, const std::vector<Segment>& segs, int64_t kvh, bool wide,
                              const std::vector<int64_t>& rows, const torch::Tensor& pos, int64_t window,
                              double scale, int64_t threads) {
  const int64_t S = static_cast<int64_t>(segs.size());
  const int64_t N = q.size(0), H = q.size(1), D = q.size(2);
  auto out = torch::empty({N, H, D}, q.options().dtype(at::kFloat));
  if (N == 0) return out;
  const int64_t* P = pos.data_ptr<int64_t>();
  std::vector<int64_t> seg_of(static_cast<size_t>(N));
  int64_t work = 0;
  for (int64_t s = 0; s < S; ++s)
    for (int64_t r = rows[s]; r < rows[s + 1]; ++r) {
      const int64_t t = P[r];
      const int64_t a = window > 0 ? std::max<int64_t>(0, t - window + 1) : 0;
      TORCH_CHECK(t >= 0 && a >= segs[s].lo && t < segs[s].lo + segs[s].len,
                  "cpu_attention: a query's keys (positions ", a, "..", t, ") outside its segment's (", segs[s].lo,
                  "..", segs[s].lo + segs[s].len - 1, ")");
      seg_of[r] = s;
      work += (t - a + 1) * H * D;
    }
  const int64_t g = H / kvh;
  const float sc = static_cast<float>(scale);
  float* O = out.data_ptr<float>();
  const bool qwide = q.scalar_type() == at::kFloat;
  // f(q's element type, K/V's element type): the four dtype pairs in one place
  auto typed = [&](auto f) {
    if (qwide) {
      if (wide) f(float{}, float{}); else f(float{}, bf16{});
    } else {
      if (wide) f(bf16{}, float{}); else f(bf16{}, bf16{});
    }
  };
  auto one_row = [&](int64_t r, int64_t kh) {
    const Segment& s = segs[seg_of[r]];
    typed([&](auto tq, auto tk) {
      using TQ = decltype(tq);
      using T = decltype(tk);
      attend_item<TQ, T>(q.data_ptr<TQ>() + r * H * D, s, P[r], window, kh, g, D, sc, O + r * H * D);
    });
  };
#if defined(KVL_HSUM16)
  // an item: up to 4 consecutive rows of one segment (a prompt's rows share K/V loads), one kv head
  std::vector<int64_t> first;             // each tile's first row
  for (int64_t s = 0; s < S; ++s)
    for (int64_t r = rows[s]; r < rows[s + 1]; r += 4) first.push_back(r);
  first.push_back(N);
  auto item = [&](int64_t b) {
    const int64_t tile = b / kvh, kh = b % kvh;
    const int64_t r0 = first[tile];
    const int R = static_cast<int>(std::min<int64_t>(4, rows[seg_of[r0] + 1] - r0));
    if (R == 1) return one_row(r0, kh);   // a decode row: no company to share loads with (a tile would score it 4 times)
    const Segment& s = segs[seg_of[r0]];
    if (!s.runs.empty()) {                // paged: row by row (the tile's loads assume one run; same bits)
      for (int i = 0; i < R; ++i) one_row(r0 + i, kh);
      return;
    }
    float* outs[4];
    for (int i = 0; i < R; ++i) outs[i] = O + (r0 + i) * H * D;
    typed([&](auto tq, auto tk) {
      using TQ = decltype(tq);
      using T = decltype(tk);
      const TQ* qs[4];
      for (int i = 0; i < R; ++i) qs[i] = q.data_ptr<TQ>() + (r0 + i) * H * D;
      attend_tile<TQ, T>(qs, R, s, P + r0, window, kh, g, D, sc, outs);
    });
  };
  const int64_t items = static_cast<int64_t>(first.size() - 1) * kvh;
#else
  auto item = [&](int64_t b) { one_row(b / kvh, b % kvh); };
  const int64_t items = N * kvh;
#endif
  // like the product: a small call is done before a helper could join
  if (threads == 1 || work < (int64_t{1} << 17)) {
    for (int64_t b = 0; b < items; ++b) item(b);
  } else {
    pool()->run(items, item);
  }
  return out;
}

}  // namespace

// q [N, H, D]; keys[s], values[s] [L_s, kvh, D] holding positions key_lo[s] .. key_lo[s] + L_s - 1;
// rows[s] .. rows[s + 1] are segment s's query rows, at positions pos [N]. Returns float32 [N, H, D].
torch::Tensor attention(torch::Tensor q, std::vector<torch::Tensor> keys, std::vector<torch::Tensor> values,
                        std::vector<int64_t> rows, torch::Tensor pos, std::vector<int64_t> key_lo, int64_t window,
                        double scale, int64_t threads) {
  TORCH_CHECK(q.device().is_cpu() && q.dim() == 3, "cpu_attention: q [N, H, D] on the CPU");
  TORCH_CHECK(q.scalar_type() == at::kFloat || q.scalar_type() == at::kBFloat16, "cpu_attention: float32 or bfloat16");
  const int64_t S = static_cast<int64_t>(keys.size());
  TORCH_CHECK(static_cast<int64_t>(values.size()) == S && static_cast<int64_t>(key_lo.size()) == S &&
              static_cast<int64_t>(rows.size()) == S + 1, "cpu_attention: one keys/values/key_lo per segment, S+1 row bounds");
  q = q.contiguous();
  pos = pos.to(at::kLong).contiguous();
  const int64_t N = q.size(0), H = q.size(1), D = q.size(2);
  TORCH_CHECK(pos.numel() == N && rows[0] == 0 && rows[S] == N, "cpu_attention: rows and positions cover q");
  std::vector<Segment> segs(static_cast<size_t>(S));
  int64_t kvh = 0;
  const bool wide = S > 0 && keys[0].scalar_type() == at::kFloat;
  for (int64_t s = 0; s < S; ++s) {
    const auto& k = keys[s];
    const auto& v = values[s];
    TORCH_CHECK(k.dim() == 3 && v.sizes() == k.sizes() && k.strides() == v.strides() && k.size(2) == D &&
                k.stride(2) == 1 && k.stride(1) == D && k.device().is_cpu(),
                "cpu_attention: keys and values [L, kvh, D], rows of kvh * D contiguous elements");
    TORCH_CHECK(k.scalar_type() == v.scalar_type() && (k.scalar_type() == at::kFloat) == wide &&
                (wide || k.scalar_type() == at::kBFloat16), "cpu_attention: K/V all float32 or all bfloat16");
    kvh = s == 0 ? k.size(1) : kvh;
    TORCH_CHECK(k.size(1) == kvh && kvh > 0 && H % kvh == 0, "cpu_attention: H a multiple of the kv heads");
    TORCH_CHECK(rows[s] <= rows[s + 1], "cpu_attention: row bounds in order");
    segs[s] = {k.data_ptr(), v.data_ptr(), k.stride(0), key_lo[s], k.size(0), {}};
  }
  return attend_segments(q, segs, S > 0 ? kvh : 1, wide, rows, pos, window, scale, threads);
}

// attention() for segments whose K/V live in per-request buffers [layers, capacity, kvh, D]
// (worker.model.dense.state.DenseState): first segment s's new rows k/v [rows[s], rows[s + 1])
// are copied into its buffers at layer `layer`, positions start[s] on (what DenseState.write
// does), then its queries read that layer's positions key_lo[s] .. start[s] + its row count - 1
// in place. One call per layer for the whole batch, where a Python loop over the segments cost
// ~30 us each per layer; the arithmetic is attention()'s own.
// prefixes[s] (int64 [layers, nb, 2], or empty): segment s's positions 0 .. nb * block_size - 1 lie
// in cached blocks read in place (worker.model.dense.state.DenseState.prefix_table): block b's K
// and V rows of layer l at the addresses [l, b, 0] and [l, b, 1], block_size rows each, a row
// apart as in the buffers; its buffers hold the positions from nb * block_size on (new rows are
// never written into a cached block).
torch::Tensor attention_cached(torch::Tensor q, torch::Tensor k, torch::Tensor v, std::vector<torch::Tensor> kbufs,
                               std::vector<torch::Tensor> vbufs, int64_t layer, std::vector<int64_t> start,
                               std::vector<int64_t> rows, torch::Tensor pos, std::vector<int64_t> key_lo,
                               int64_t window, double scale, int64_t threads,
                               std::vector<torch::Tensor> prefixes, int64_t block_size) {
  TORCH_CHECK(q.device().is_cpu() && q.dim() == 3, "cpu_attention: q [N, H, D] on the CPU");
  TORCH_CHECK(q.scalar_type() == at::kFloat || q.scalar_type() == at::kBFloat16, "cpu_attention: float32 or bfloat16");
  const int64_t S = static_cast<int64_t>(kbufs.size());
  TORCH_CHECK(static_cast<int64_t>(vbufs.size()) == S && static_cast<int64_t>(start.size()) == S &&
              static_cast<int64_t>(key_lo.size()) == S && static_cast<int64_t>(rows.size()) == S + 1 &&
              (prefixes.empty() || static_cast<int64_t>(prefixes.size()) == S),
              "cpu_attention: one buffer pair, start and key_lo (and prefix table) per segment, S+1 row bounds");
  q = q.contiguous();
  pos = pos.to(at::kLong).contiguous();
  const int64_t N = q.size(0), H = q.size(1), D = q.size(2);
  TORCH_CHECK(pos.numel() == N && rows[0] == 0 && rows[S] == N, "cpu_attention: rows and positions cover q");
  TORCH_CHECK(k.dim() == 3 && v.sizes() == k.sizes() && k.size(0) == N && k.size(2) == D,
              "cpu_attention: new k and v [N, kvh, D]");
  const int64_t kvh = k.size(1);
  TORCH_CHECK(kvh > 0 && H % kvh == 0, "cpu_attention: H a multiple of the kv heads");
  // each new row's kvh * D elements contiguous (rows may be strided: views of a fused product)
  if (!(k.stride(2) == 1 && k.stride(1) == D)) k = k.contiguous();
  if (!(v.stride(2) == 1 && v.stride(1) == D)) v = v.contiguous();
  const auto dt = k.scalar_type();
  TORCH_CHECK(v.scalar_type() == dt && (dt == at::kFloat || dt == at::kBFloat16), "cpu_attention: K/V float32 or bfloat16");
  const int64_t row = kvh * D, esize = k.element_size();
  std::vector<Segment> segs(static_cast<size_t>(S));
  for (int64_t s = 0; s < S; ++s) {
    const auto& kb = kbufs[s];
    const auto& vb = vbufs[s];
    TORCH_CHECK(kb.dim() == 4 && vb.sizes() == kb.sizes() && kb.is_contiguous() && vb.is_contiguous() &&
                kb.scalar_type() == dt && vb.scalar_type() == dt && kb.size(2) == kvh && kb.size(3) == D &&
                kb.device().is_cpu() && vb.device().is_cpu(),
                "cpu_attention: buffers [layers, capacity, kvh, D], contiguous, of the new rows' dtype");
    const int64_t n = rows[s + 1] - rows[s];
    TORCH_CHECK(rows[s] <= rows[s + 1] && layer >= 0 && layer < kb.size(0) && start[s] >= 0 &&
                start[s] + n <= kb.size(1) && key_lo[s] >= 0 && key_lo[s] <= start[s],
                "cpu_attention: a segment's rows outside its buffers");
    char* kl = static_cast<char*>(kb.data_ptr()) + (layer * kb.size(1)) * row * esize;
    char* vl = static_cast<char*>(vb.data_ptr()) + (layer * vb.size(1)) * row * esize;
    const char* ks = static_cast<const char*>(k.data_ptr());
    const char* vs = static_cast<const char*>(v.data_ptr());
    for (int64_t i = 0; i < n; ++i) {
      std::memcpy(kl + (start[s] + i) * row * esize, ks + (rows[s] + i) * k.stride(0) * esize, row * esize);
      std::memcpy(vl + (start[s] + i) * row * esize, vs + (rows[s] + i) * v.stride(0) * esize, row * esize);
    }
    const int64_t end = start[s] + n;
    segs[s] = {kl + key_lo[s] * row * esize, vl + key_lo[s] * row * esize, row, key_lo[s], end - key_lo[s], {}};
    const torch::Tensor* tab = prefixes.empty() || prefixes[s].numel() == 0 ? nullptr : &prefixes[s];
    if (tab != nullptr) {
      TORCH_CHECK(tab->dim() == 3 && tab->size(2) == 2 && tab->scalar_type() == at::kLong && tab->is_contiguous() &&
                  tab->size(0) == kb.size(0) && block_size > 0,
                  "cpu_attention: a prefix table is int64 [layers, blocks, 2], contiguous, one row per layer");
      const int64_t nb = tab->size(1), cached = nb * block_size;
      TORCH_CHECK(start[s] >= cached && cached <= kb.size(1),
                  "cpu_attention: new rows written into a cached block (start ", start[s], " < ", cached, ")");
      if (key_lo[s] < cached) {
        const int64_t* at = tab->data_ptr<int64_t>() + layer * nb * 2;
        auto& runs = segs[s].runs;
        runs.reserve(static_cast<size_t>(nb + 1));
        for (int64_t b = key_lo[s] / block_size; b < nb; ++b)
          runs.push_back({reinterpret_cast<const void*>(at[2 * b]), reinterpret_cast<const void*>(at[2 * b + 1]),
                          b * block_size, block_size});
        if (end > cached) runs.push_back({kl + cached * row * esize, vl + cached * row * esize, cached, end - cached});
      }
    }
  }
  return attend_segments(q, segs, kvh, dt == at::kFloat, rows, pos, window, scale, threads);
}
