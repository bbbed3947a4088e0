// omnimesh's fused CPU kernels: the small per-token work of a decoder step in one call each.
//
// Role: on CPU a decode step of a small model (or any model at a small batch) costs mostly fixed per-op
// overhead: Python, the dispatcher, a TensorIterator per elementwise op. These kernels do in one call
// what eager PyTorch does in 5-15 ops (the same jobs vLLM's and SGLang's CPU backends keep custom ops for):
//   rms_norm       y = x / sqrt(mean(x^2) + eps) * w                                   (any rows, H last)
//   qk_norm_rope   fused qkv (B, T, (h + 2 kv) D) -> q (B, h, T, D), k, v (B, kv, T, D): q and k
//                  per-head RMS-normed and rotated, y * cos + roll(y, D/2) * sin_signed
//   mrope          interleaved M-RoPE tables cos, sin_signed (1, T, D) from positions (3, T)
//   attention      q (B, h, T, D) over contiguous k / v (B, kv, S, D), causal by position (+ window)
//   paged_decode   writes a step's new k / v into the paged pool and attends each one-token request
//                  over its own slots (no gather of the keys into a padded batch)
//   silu_mul       silu(x[..., :I]) * x[..., I:]
//   greedy_pick    greedy sampling of B rows at once: repetition penalty over each row's history, suppressed
//                  ids at -inf, argmax (the first maximum, as torch.argmax)
//   snake          the vocoder's SnakeBeta, x + inv_beta * sin(alpha x)^2 per channel (Sleef's vectorised sin)
//   moe            router softmax -> top-k (at::topk itself, so ties break as transformers') -> the
//                  routed experts (+ a sigmoid-gated shared expert) token by token
//   dense_layer    a whole dense decoder layer (the code predictor's) over a small contiguous cache: the kernels
//                  above and aten's linear in one call, no Python between them
//   decode_layer   the same for a decoder layer of a decode-only batched step over the paged pool (LM stages)
// Data flow: omnimesh/kernels/cpu_kernels.py builds this file once per machine (torch.utils.cpp_extension,
// cached) and the model layers call torch.ops.omnimesh.* for float32 CPU tensors of small steps; everything
// else (CUDA, other dtypes, large steps where aten's vectorised and threaded kernels win) stays on aten.
// Every kernel works row by row (a row's result does not depend on the batch it is in); a large call spreads
// its rows over the process's intra-op threads (at::parallel_for), a small one runs inline on the calling
// thread. Values equal the eager formulas up to float rounding (tests/kernels).
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <vector>

#if defined(__AVX512F__) || defined(__AVX2__)
#include <immintrin.h>
#include <sleef.h>  // ships with torch (torch/include); libtorch_cpu exports its vectorised sin
#endif

namespace {

// sum_i a[i] * b[i]
inline float dot(const float* a, const float* b, int64_t n) {
  int64_t i = 0;
  float s = 0.f;
#if defined(__AVX512F__)
  __m512 acc = _mm512_setzero_ps();
  for (; i + 16 <= n; i += 16) acc = _mm512_fmadd_ps(_mm512_loadu_ps(a + i), _mm512_loadu_ps(b + i), acc);
  s = _mm512_reduce_add_ps(acc);
#elif defined(__AVX2__) && defined(__FMA__)
  __m256 acc = _mm256_setzero_ps();
  for (; i + 8 <= n; i += 8) acc = _mm256_fmadd_ps(_mm256_loadu_ps(a + i), _mm256_loadu_ps(b + i), acc);
  __m128 r = _mm_add_ps(_mm256_castps256_ps128(acc), _mm256_extractf128_ps(acc, 1));
  r = _mm_add_ps(r, _mm_movehl_ps(r, r));
  r = _mm_add_ss(r, _mm_shuffle_ps(r, r, 1));
  s = _mm_cvtss_f32(r);
#else
  float acc[4] = {0.f, 0.f, 0.f, 0.f};
  for (; i + 4 <= n; i += 4)
    for (int l = 0; l < 4; ++l) acc[l] += a[i + l] * b[i + l];
  s = (acc[0] + acc[2]) + (acc[1] + acc[3]);
#endif
  for (; i < n; ++i) s += a[i] * b[i];
  return s;
}

// y (rows) = W (rows, cols) x (cols)
inline void gemv(const float* W, const float* x, int64_t rows, int64_t cols, float* y) {
  for (int64_t r = 0; r < rows; ++r) y[r] = dot(W + r * cols, x, cols);
}

// rows per task of at::parallel_for for rows of `per_row` floats of work: a small step runs inline on the calling
// thread (no pool hand-off), a large one spreads over the process's intra-op threads (torch.set_num_threads)
inline int64_t grain(int64_t per_row) { return std::max<int64_t>(1, 32768 / std::max<int64_t>(1, per_row)); }

inline float silu(float g) { return g / (1.0f + std::exp(-g)); }

inline float inv_rms(const float* x, int64_t n, float eps) {
  return 1.0f / std::sqrt(dot(x, x, n) / static_cast<float>(n) + eps);
}

void check_cpu_f32(const at::Tensor& t, const char* name) {
  TORCH_CHECK(t.device().is_cpu(), "omnimesh kernel: ", name, " must be on the CPU");
  TORCH_CHECK(t.scalar_type() == at::kFloat, "omnimesh kernel: ", name, " must be float32, got ", t.scalar_type());
}

void check_index(const at::Tensor& t, const char* name) {
  TORCH_CHECK(t.device().is_cpu() && t.scalar_type() == at::kLong && t.is_contiguous(), "omnimesh kernel: ", name,
              " must be a contiguous int64 CPU tensor");
}

at::Tensor rms_norm(const at::Tensor& x_in, const c10::optional<at::Tensor>& weight, double eps) {
  check_cpu_f32(x_in, "x");
  TORCH_CHECK(x_in.dim() >= 1, "omnimesh kernel: rms_norm needs at least one dimension");
  const at::Tensor x = x_in.contiguous();
  const int64_t H = x.size(-1), N = H ? x.numel() / H : 0;
  at::Tensor w;
  if (weight.has_value()) {
    w = weight->contiguous();
    check_cpu_f32(w, "weight");
    TORCH_CHECK(w.numel() == H, "omnimesh kernel: rms_norm weight has ", w.numel(), " values for rows of ", H);
  }
  at::Tensor out = at::empty_like(x);
  const float* xp = x.data_ptr<float>();
  const float* wp = w.defined() ? w.data_ptr<float>() : nullptr;
  float* op = out.data_ptr<float>();
  const float e = static_cast<float>(eps);
  at::parallel_for(0, N, grain(H), [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) {
      const float* r = xp + i * H;
      float* o = op + i * H;
      const float inv = inv_rms(r, H, e);
      if (wp) {
        for (int64_t j = 0; j < H; ++j) o[j] = (r[j] * inv) * wp[j];
      } else {
        for (int64_t j = 0; j < H; ++j) o[j] = r[j] * inv;
      }
    }
  });
  return out;
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> qk_norm_rope(
    const at::Tensor& qkv_in, int64_t heads, int64_t kv_heads, int64_t head_dim,
    const c10::optional<at::Tensor>& q_weight, const c10::optional<at::Tensor>& k_weight, double eps,
    const at::Tensor& cos_in, const at::Tensor& sin_in) {
  check_cpu_f32(qkv_in, "qkv");
  const int64_t D = head_dim;
  TORCH_CHECK(heads > 0 && kv_heads > 0 && D > 0 && D % 2 == 0, "omnimesh kernel: qk_norm_rope needs heads, kv_heads "
              "> 0 and an even head_dim, got ", heads, ", ", kv_heads, ", ", D);
  TORCH_CHECK(qkv_in.dim() == 3 && qkv_in.size(2) == (heads + 2 * kv_heads) * D, "omnimesh kernel: qkv must be "
              "(B, T, (heads + 2 kv_heads) head_dim) = (B, T, ", (heads + 2 * kv_heads) * D, "), got ", qkv_in.sizes());
  TORCH_CHECK(q_weight.has_value() == k_weight.has_value(), "omnimesh kernel: give both q and k norm weights or none");
  const at::Tensor qkv = qkv_in.contiguous(), cs = cos_in.contiguous(), sn = sin_in.contiguous();
  const int64_t B = qkv.size(0), T = qkv.size(1), W = qkv.size(2);
  check_cpu_f32(cs, "cos");
  check_cpu_f32(sn, "sin");
  TORCH_CHECK(cs.dim() == 3 && cs.size(1) == T && cs.size(2) == D && (cs.size(0) == 1 || cs.size(0) == B),
              "omnimesh kernel: cos must be (1 or B, T, head_dim), got ", cs.sizes());
  TORCH_CHECK(sn.sizes() == cs.sizes(), "omnimesh kernel: sin must have cos's shape ", cs.sizes(), ", got ", sn.sizes());
  at::Tensor qw, kw;
  if (q_weight.has_value()) {
    qw = q_weight->contiguous();
    kw = k_weight->contiguous();
    check_cpu_f32(qw, "q_weight");
    check_cpu_f32(kw, "k_weight");
    TORCH_CHECK(qw.numel() == D && kw.numel() == D, "omnimesh kernel: q/k norm weights must have head_dim values");
  }
  const auto opts = qkv.options();
  at::Tensor q = at::empty({B, heads, T, D}, opts), k = at::empty({B, kv_heads, T, D}, opts),
             v = at::empty({B, kv_heads, T, D}, opts);
  const float* src = qkv.data_ptr<float>();
  const float* cp = cs.data_ptr<float>();
  const float* sp = sn.data_ptr<float>();
  const float* qwp = qw.defined() ? qw.data_ptr<float>() : nullptr;
  const float* kwp = kw.defined() ? kw.data_ptr<float>() : nullptr;
  float* qp = q.data_ptr<float>();
  float* kp = k.data_ptr<float>();
  float* vp = v.data_ptr<float>();
  const float e = static_cast<float>(eps);
  const int64_t half = D / 2;
  at::parallel_for(0, B * T, grain(W), [&](int64_t begin, int64_t end) {
    std::vector<float> y(D);
    for (int64_t bt = begin; bt < end; ++bt) {
      const int64_t b = bt / T, t = bt % T, cb = cs.size(0) == 1 ? 0 : b;
      const float* row = src + (b * T + t) * W;
      const float* c = cp + (cb * T + t) * D;
      const float* s = sp + (cb * T + t) * D;
      for (int64_t hh = 0; hh < heads + kv_heads; ++hh) {
        const float* x = row + hh * D;
        const bool is_q = hh < heads;
        const float* w = is_q ? qwp : kwp;
        if (w) {
          const float inv = inv_rms(x, D, e);
          for (int64_t d = 0; d < D; ++d) y[d] = (x[d] * inv) * w[d];
        } else {
          std::copy(x, x + D, y.begin());
        }
        float* o = is_q ? qp + ((b * heads + hh) * T + t) * D : kp + ((b * kv_heads + hh - heads) * T + t) * D;
        for (int64_t d = 0; d < half; ++d) o[d] = y[d] * c[d] + y[d + half] * s[d];
        for (int64_t d = half; d < D; ++d) o[d] = y[d] * c[d] + y[d - half] * s[d];
      }
      for (int64_t hh = 0; hh < kv_heads; ++hh) {
        const float* x = row + (heads + kv_heads + hh) * D;
        std::copy(x, x + D, vp + ((b * kv_heads + hh) * T + t) * D);
      }
    }
  });
  return {q, k, v};
}

std::tuple<at::Tensor, at::Tensor> mrope(const at::Tensor& positions_in, const at::Tensor& inv_freq_in,
                                         int64_t section_h, int64_t section_w) {
  check_cpu_f32(positions_in, "positions");
  check_cpu_f32(inv_freq_in, "inv_freq");
  TORCH_CHECK(positions_in.dim() == 2 && positions_in.size(0) == 3, "omnimesh kernel: mrope positions must be (3, T), "
              "got ", positions_in.sizes());
  const at::Tensor pos = positions_in.contiguous(), inv = inv_freq_in.contiguous();
  const int64_t T = pos.size(1), half = inv.numel(), D = 2 * half;
  TORCH_CHECK(section_h >= 0 && section_w >= 0, "omnimesh kernel: mrope sections must be >= 0");
  at::Tensor cos = at::empty({1, T, D}, pos.options()), sin = at::empty({1, T, D}, pos.options());
  const float* pp = pos.data_ptr<float>();
  const float* ip = inv.data_ptr<float>();
  float* cp = cos.data_ptr<float>();
  float* sp = sin.data_ptr<float>();
  for (int64_t t = 0; t < T; ++t) {
    for (int64_t d = 0; d < half; ++d) {
      // interleaved sections: frequency d reads the h (w) position on slots 1, 4, ... (2, 5, ...) of its section
      int64_t axis = 0;
      if (d % 3 == 1 && d < 3 * section_h) axis = 1;
      if (d % 3 == 2 && d < 3 * section_w) axis = 2;
      const float f = pp[axis * T + t] * ip[d];
      const float c = std::cos(f), s = std::sin(f);
      cp[t * D + d] = c;
      cp[t * D + half + d] = c;
      sp[t * D + d] = -s;  // sin_signed: the sign of rotate_half folded into the table's first half
      sp[t * D + half + d] = s;
    }
  }
  return {cos, sin};
}

// one query (D) over n keys / values given by row pointers -> out (D); softmax in float32
inline void attend_row(const float* qv, int64_t D, int64_t n, const float* const* ks, const float* const* vs,
                       float scale, float* out, std::vector<float>& p) {
  p.resize(n);
  float m = -INFINITY;
  for (int64_t j = 0; j < n; ++j) {
    p[j] = dot(qv, ks[j], D) * scale;
    m = std::max(m, p[j]);
  }
  float sum = 0.f;
  for (int64_t j = 0; j < n; ++j) {
    p[j] = std::exp(p[j] - m);
    sum += p[j];
  }
  std::fill(out, out + D, 0.f);
  for (int64_t j = 0; j < n; ++j) {
    const float pj = p[j];
    const float* vj = vs[j];
    for (int64_t d = 0; d < D; ++d) out[d] += pj * vj[d];
  }
  const float inv = 1.0f / sum;
  for (int64_t d = 0; d < D; ++d) out[d] *= inv;
}

at::Tensor attention(const at::Tensor& q_in, const at::Tensor& k_in, const at::Tensor& v_in, int64_t q_start,
                     int64_t k_start, int64_t window, double scale) {
  check_cpu_f32(q_in, "q");
  check_cpu_f32(k_in, "k");
  check_cpu_f32(v_in, "v");
  TORCH_CHECK(q_in.dim() == 4 && k_in.dim() == 4 && v_in.sizes() == k_in.sizes(), "omnimesh kernel: attention takes "
              "q (B, h, T, D) and k, v (B, kv, S, D), got ", q_in.sizes(), ", ", k_in.sizes(), ", ", v_in.sizes());
  const at::Tensor q = q_in.contiguous(), k = k_in.contiguous(), v = v_in.contiguous();
  const int64_t B = q.size(0), h = q.size(1), T = q.size(2), D = q.size(3), kv = k.size(1), S = k.size(2);
  TORCH_CHECK(k.size(0) == B && k.size(3) == D && kv > 0 && h % kv == 0, "omnimesh kernel: attention shapes do not "
              "match: q ", q.sizes(), ", k ", k.sizes());
  const int64_t rep = h / kv;
  at::Tensor out = at::empty_like(q);
  const float* qp = q.data_ptr<float>();
  const float* kp = k.data_ptr<float>();
  const float* vp = v.data_ptr<float>();
  float* op = out.data_ptr<float>();
  const float sc = static_cast<float>(scale);
  at::parallel_for(0, B * kv * T, grain(rep * S * D), [&](int64_t begin, int64_t end) {
    std::vector<const float*> ks(S), vs(S);
    std::vector<float> p;
    for (int64_t bgt = begin; bgt < end; ++bgt) {
      const int64_t b = bgt / (kv * T), g = bgt / T % kv, t = bgt % T;
      {
        const int64_t qpos = q_start + t;
        int64_t n = 0;
        for (int64_t j = 0; j < S; ++j) {
          const int64_t kpos = k_start + j;
          if (kpos > qpos || (window > 0 && qpos - kpos >= window)) continue;
          ks[n] = kp + ((b * kv + g) * S + j) * D;
          vs[n] = vp + ((b * kv + g) * S + j) * D;
          ++n;
        }
        TORCH_CHECK(n > 0, "omnimesh kernel: attention query at position ", qpos, " sees no key");
        for (int64_t hh = g * rep; hh < (g + 1) * rep; ++hh)
          attend_row(qp + ((b * h + hh) * T + t) * D, D, n, ks.data(), vs.data(), sc, op + ((b * h + hh) * T + t) * D, p);
      }
    }
  });
  return out;
}

void paged_decode(const at::Tensor& q_in, const at::Tensor& k_in, const at::Tensor& v_in, at::Tensor k_pool,
                  at::Tensor v_pool, const at::Tensor& write_slots, const at::Tensor& rows, const at::Tensor& slots,
                  const at::Tensor& lens, double scale, at::Tensor out) {
  for (const auto& [t, name] : {std::pair{q_in, "q"}, {k_in, "k"}, {v_in, "v"}, {k_pool, "k_pool"},
                                {v_pool, "v_pool"}, {out, "out"}})
    check_cpu_f32(t, name);
  for (const auto& [t, name] : {std::pair{write_slots, "write_slots"}, {rows, "rows"}, {slots, "slots"}, {lens, "lens"}})
    check_index(t, name);
  TORCH_CHECK(k_pool.is_contiguous() && v_pool.is_contiguous() && out.is_contiguous() && out.sizes() == q_in.sizes(),
              "omnimesh kernel: paged_decode needs contiguous pools and an out shaped like q");
  const at::Tensor q = q_in.contiguous(), k = k_in.contiguous(), v = v_in.contiguous();
  TORCH_CHECK(q.dim() == 4 && q.size(0) == 1 && k.dim() == 4 && k.size(0) == 1 && v.sizes() == k.sizes(),
              "omnimesh kernel: paged_decode takes packed q (1, h, N, D) and k, v (1, kv, N, D)");
  const int64_t h = q.size(1), N = q.size(2), D = q.size(3), kv = k.size(1);
  TORCH_CHECK(k.size(2) == N && k.size(3) == D && kv > 0 && h % kv == 0 && k_pool.dim() == 3 &&
              k_pool.size(1) == kv && k_pool.size(2) == D && v_pool.sizes() == k_pool.sizes(),
              "omnimesh kernel: paged_decode shapes do not match: q ", q.sizes(), ", k ", k.sizes(), ", pool ",
              k_pool.sizes());
  TORCH_CHECK(write_slots.numel() == N, "omnimesh kernel: paged_decode needs one write slot per packed token");
  const int64_t Bd = rows.numel(), Smax = slots.dim() == 2 ? slots.size(1) : 0, num_slots = k_pool.size(0);
  TORCH_CHECK(lens.numel() == Bd && (Bd == 0 || (slots.dim() == 2 && slots.size(0) == Bd)),
              "omnimesh kernel: paged_decode needs slots (Bd, Smax) and lens (Bd,) for its Bd decode rows");
  const int64_t rep = h / kv;
  float* kpp = k_pool.data_ptr<float>();
  float* vpp = v_pool.data_ptr<float>();
  const float* kp = k.data_ptr<float>();
  const float* vp = v.data_ptr<float>();
  const float* qp = q.data_ptr<float>();
  float* op = out.data_ptr<float>();
  const int64_t* ws = write_slots.data_ptr<int64_t>();
  for (int64_t n = 0; n < N; ++n) {
    const int64_t s = ws[n];
    TORCH_CHECK(s >= 0 && s < num_slots, "omnimesh kernel: write slot ", s, " is outside the pool's ", num_slots);
    for (int64_t g = 0; g < kv; ++g) {
      std::copy(kp + (g * N + n) * D, kp + (g * N + n + 1) * D, kpp + (s * kv + g) * D);
      std::copy(vp + (g * N + n) * D, vp + (g * N + n + 1) * D, vpp + (s * kv + g) * D);
    }
  }
  const int64_t* rp = rows.data_ptr<int64_t>();
  const int64_t* sp = slots.data_ptr<int64_t>();
  const int64_t* lp = lens.data_ptr<int64_t>();
  for (int64_t i = 0; i < Bd; ++i) {  // every index checked before any thread reads the pool
    TORCH_CHECK(rp[i] >= 0 && rp[i] < N && lp[i] >= 1 && lp[i] <= Smax, "omnimesh kernel: decode row ", i,
                " (packed row ", rp[i], ", ", lp[i], " keys) is outside the step");
    for (int64_t j = 0; j < lp[i]; ++j)
      TORCH_CHECK(sp[i * Smax + j] >= 0 && sp[i * Smax + j] < num_slots, "omnimesh kernel: slot ", sp[i * Smax + j],
                  " is outside the pool's ", num_slots);
  }
  const float sc = static_cast<float>(scale);
  at::parallel_for(0, Bd * kv, grain(rep * Smax * D), [&](int64_t begin, int64_t end) {
    std::vector<const float*> ks(Smax), vs(Smax);
    std::vector<float> p;
    for (int64_t ig = begin; ig < end; ++ig) {
      const int64_t i = ig / kv, g = ig % kv, r = rp[i], n = lp[i];
      for (int64_t j = 0; j < n; ++j) {
        const int64_t s = sp[i * Smax + j];
        ks[j] = kpp + (s * kv + g) * D;
        vs[j] = vpp + (s * kv + g) * D;
      }
      for (int64_t hh = g * rep; hh < (g + 1) * rep; ++hh)
        attend_row(qp + (hh * N + r) * D, D, n, ks.data(), vs.data(), sc, op + (hh * N + r) * D, p);
    }
  });
}

at::Tensor silu_mul(const at::Tensor& x_in) {
  check_cpu_f32(x_in, "x");
  TORCH_CHECK(x_in.dim() >= 1 && x_in.size(-1) % 2 == 0, "omnimesh kernel: silu_mul needs an even last dimension");
  const at::Tensor x = x_in.contiguous();
  const int64_t W = x.size(-1), I = W / 2, N = W ? x.numel() / W : 0;
  auto sizes = x.sizes().vec();
  sizes.back() = I;
  at::Tensor out = at::empty(sizes, x.options());
  const float* xp = x.data_ptr<float>();
  float* op = out.data_ptr<float>();
  at::parallel_for(0, N, grain(W), [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) {
      const float* g = xp + i * W;
      const float* u = g + I;
      float* o = op + i * I;
      for (int64_t j = 0; j < I; ++j) o[j] = silu(g[j]) * u[j];
    }
  });
  return out;
}

at::Tensor moe(const at::Tensor& h_in, const at::Tensor& router_in, const at::Tensor& gate_up_in,
               const at::Tensor& down_in, int64_t top_k, bool norm_topk, const c10::optional<at::Tensor>& shared_gate_up,
               const c10::optional<at::Tensor>& shared_down, const c10::optional<at::Tensor>& shared_gate) {
  for (const auto& [t, name] : {std::pair{h_in, "h"}, {router_in, "router"}, {gate_up_in, "gate_up"}, {down_in, "down"}})
    check_cpu_f32(t, name);
  const at::Tensor h = h_in.contiguous(), router = router_in.contiguous(), gate_up = gate_up_in.contiguous(),
                   down = down_in.contiguous();
  TORCH_CHECK(h.dim() == 2 && router.dim() == 2 && gate_up.dim() == 3 && down.dim() == 3, "omnimesh kernel: moe takes "
              "h (N, H), router (E, H), gate_up (E, 2I, H), down (E, H, I)");
  const int64_t N = h.size(0), H = h.size(1), E = router.size(0), I2 = gate_up.size(1), I = I2 / 2;
  TORCH_CHECK(router.size(1) == H && gate_up.size(0) == E && gate_up.size(2) == H && I2 % 2 == 0 &&
              down.size(0) == E && down.size(1) == H && down.size(2) == I,
              "omnimesh kernel: moe shapes do not match: h ", h.sizes(), ", router ", router.sizes(), ", gate_up ",
              gate_up.sizes(), ", down ", down.sizes());
  TORCH_CHECK(top_k >= 1 && top_k <= E, "omnimesh kernel: moe top_k ", top_k, " must be in 1..", E);
  const bool shared = shared_gate_up.has_value();
  TORCH_CHECK(shared == shared_down.has_value() && shared == shared_gate.has_value(),
              "omnimesh kernel: a shared expert needs its gate_up, down and gate");
  at::Tensor sgu, sdown, sgate;
  int64_t Is2 = 0;
  if (shared) {
    sgu = shared_gate_up->contiguous();
    sdown = shared_down->contiguous();
    sgate = shared_gate->contiguous();
    Is2 = sgu.size(0);
    TORCH_CHECK(sgu.dim() == 2 && sgu.size(1) == H && Is2 % 2 == 0 && sdown.dim() == 2 && sdown.size(0) == H &&
                sdown.size(1) == Is2 / 2 && sgate.numel() == H, "omnimesh kernel: moe shared expert shapes do not match");
  }
  // router softmax in float32, then at::topk itself: its order among equal weights (e.g. a zero router) is what
  // transformers' torch.topk gives
  at::Tensor probs = at::empty({N, E}, h.options());
  const float* hp = h.data_ptr<float>();
  float* pp = probs.data_ptr<float>();
  for (int64_t n = 0; n < N; ++n) {
    float* l = pp + n * E;
    gemv(router.data_ptr<float>(), hp + n * H, E, H, l);
    const float m = *std::max_element(l, l + E);
    float sum = 0.f;
    for (int64_t e = 0; e < E; ++e) {
      l[e] = std::exp(l[e] - m);
      sum += l[e];
    }
    for (int64_t e = 0; e < E; ++e) l[e] /= sum;
  }
  const auto [top_w, top_i] = at::topk(probs, top_k, -1, true, true);
  const float* twp = top_w.data_ptr<float>();
  const int64_t* tip = top_i.data_ptr<int64_t>();
  const float* gup = gate_up.data_ptr<float>();
  const float* dp = down.data_ptr<float>();
  at::Tensor out = at::zeros({N, H}, h.options());
  float* op = out.data_ptr<float>();
  const int64_t token_macs = (top_k * 3 * I + (shared ? 3 * Is2 / 2 : 0)) * H;
  at::parallel_for(0, N, grain(token_macs), [&](int64_t begin, int64_t end) {
    std::vector<float> gu(std::max(I2, Is2)), act(std::max(I2, Is2) / 2), y(H);
    for (int64_t n = begin; n < end; ++n) {
      const float* x = hp + n * H;
      float* o = op + n * H;
      float wsum = 0.f;
      for (int64_t j = 0; j < top_k; ++j) wsum += twp[n * top_k + j];
      for (int64_t j = 0; j < top_k; ++j) {
        const float w = norm_topk ? twp[n * top_k + j] / wsum : twp[n * top_k + j];
        const int64_t e = tip[n * top_k + j];
        gemv(gup + e * I2 * H, x, I2, H, gu.data());
        for (int64_t i = 0; i < I; ++i) act[i] = silu(gu[i]) * gu[I + i];
        gemv(dp + e * H * I, act.data(), H, I, y.data());
        for (int64_t d = 0; d < H; ++d) o[d] += y[d] * w;
      }
      if (shared) {
        const int64_t Is = Is2 / 2;
        const float g = 1.0f / (1.0f + std::exp(-dot(sgate.data_ptr<float>(), x, H)));
        gemv(sgu.data_ptr<float>(), x, Is2, H, gu.data());
        for (int64_t i = 0; i < Is; ++i) act[i] = silu(gu[i]) * gu[Is + i];
        gemv(sdown.data_ptr<float>(), act.data(), H, Is, y.data());
        for (int64_t d = 0; d < H; ++d) o[d] += g * y[d];
      }
    }
  });
  return out;
}

// SnakeBeta of x (B, C, T): x + inv_beta[c] * sin(alpha[c] * x)^2, alpha = exp(a), inv_beta = 1 / (exp(b) + eps)
// made by the caller once per module. The sine is Sleef's 3.5-ulp one, as inductor's kernels use.
at::Tensor snake(const at::Tensor& x_in, const at::Tensor& alpha_in, const at::Tensor& inv_beta_in) {
  check_cpu_f32(x_in, "x");
  check_cpu_f32(alpha_in, "alpha");
  check_cpu_f32(inv_beta_in, "inv_beta");
  TORCH_CHECK(x_in.dim() == 3, "omnimesh kernel: snake takes x (B, C, T), got ", x_in.sizes());
  const at::Tensor x = x_in.contiguous(), alpha = alpha_in.contiguous(), inv_beta = inv_beta_in.contiguous();
  const int64_t B = x.size(0), C = x.size(1), T = x.size(2);
  TORCH_CHECK(alpha.numel() == C && inv_beta.numel() == C, "omnimesh kernel: snake needs one alpha and inv_beta per "
              "channel (", C, "), got ", alpha.numel(), " and ", inv_beta.numel());
  at::Tensor out = at::empty_like(x);
  const float* xp = x.data_ptr<float>();
  const float* ap = alpha.data_ptr<float>();
  const float* bp = inv_beta.data_ptr<float>();
  float* op = out.data_ptr<float>();
  at::parallel_for(0, B * C, grain(T), [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      const float a = ap[r % C], ib = bp[r % C];
      const float* xr = xp + r * T;
      float* o = op + r * T;
      int64_t t = 0;
#if defined(__AVX512F__)
      const __m512 va = _mm512_set1_ps(a), vb = _mm512_set1_ps(ib);
      for (; t + 16 <= T; t += 16) {
        const __m512 v = _mm512_loadu_ps(xr + t);
        const __m512 sn = Sleef_sinf16_u35(_mm512_mul_ps(v, va));
        _mm512_storeu_ps(o + t, _mm512_add_ps(v, _mm512_mul_ps(vb, _mm512_mul_ps(sn, sn))));
      }
#elif defined(__AVX2__)
      const __m256 va = _mm256_set1_ps(a), vb = _mm256_set1_ps(ib);
      for (; t + 8 <= T; t += 8) {
        const __m256 v = _mm256_loadu_ps(xr + t);
        const __m256 sn = Sleef_sinf8_u35(_mm256_mul_ps(v, va));
        _mm256_storeu_ps(o + t, _mm256_add_ps(v, _mm256_mul_ps(vb, _mm256_mul_ps(sn, sn))));
      }
#endif
      for (; t < T; ++t) {
        const float sn = std::sin(xr[t] * a);
        o[t] = xr[t] + ib * (sn * sn);
      }
    }
  });
  return out;
}

// logits (B, V); row b's penalty history is history[offsets[b] : offsets[b + 1]] (ids >= V ignored); every id
// seen once or more is divided (> 0) or multiplied (< 0) by `penalty` once (RepetitionPenaltyLogitsProcessor);
// ids where `suppress` (V,) is true score -inf; -> (B,) the argmax of each row (its first maximum)
at::Tensor greedy_pick(const at::Tensor& logits_in, const at::Tensor& history, const at::Tensor& offsets,
                       double penalty, const c10::optional<at::Tensor>& suppress_in) {
  check_cpu_f32(logits_in, "logits");
  check_index(history, "history");
  check_index(offsets, "offsets");
  TORCH_CHECK(logits_in.dim() == 2, "omnimesh kernel: greedy_pick takes logits (B, V), got ", logits_in.sizes());
  const at::Tensor logits = logits_in.contiguous();
  const int64_t B = logits.size(0), V = logits.size(1);
  TORCH_CHECK(offsets.numel() == B + 1, "omnimesh kernel: greedy_pick needs B + 1 = ", B + 1, " offsets, got ",
              offsets.numel());
  const int64_t* off = offsets.data_ptr<int64_t>();
  TORCH_CHECK(off[0] == 0 && off[B] == history.numel(), "omnimesh kernel: greedy_pick offsets must run from 0 to the "
              "history's ", history.numel(), " ids");
  for (int64_t b = 0; b < B; ++b)
    TORCH_CHECK(off[b] <= off[b + 1], "omnimesh kernel: greedy_pick offsets must not decrease");
  const bool* sup = nullptr;
  at::Tensor suppress;
  if (suppress_in.has_value()) {
    suppress = suppress_in->contiguous();
    TORCH_CHECK(suppress.scalar_type() == at::kBool && suppress.numel() == V, "omnimesh kernel: greedy_pick suppress "
                "must be a bool mask of the ", V, " ids");
    sup = suppress.data_ptr<bool>();
  }
  const float* lp = logits.data_ptr<float>();
  const int64_t* hp = history.data_ptr<int64_t>();
  const float p = static_cast<float>(penalty);
  at::Tensor out = at::empty({B}, history.options());
  int64_t* op = out.data_ptr<int64_t>();
  std::vector<float> row(V);
  std::vector<char> seen(V);
  for (int64_t b = 0; b < B; ++b) {
    std::copy(lp + b * V, lp + (b + 1) * V, row.begin());
    if (penalty != 1.0) {
      std::fill(seen.begin(), seen.end(), 0);
      for (int64_t i = off[b]; i < off[b + 1]; ++i) {
        const int64_t id = hp[i];
        if (id < 0 || id >= V || seen[id]) continue;
        seen[id] = 1;
        row[id] = row[id] < 0 ? row[id] * p : row[id] / p;
      }
    }
    int64_t best = -1;
    float top = -INFINITY;
    for (int64_t v = 0; v < V; ++v) {
      const float x = (sup && sup[v]) ? -INFINITY : row[v];
      if (best < 0 || x > top || (std::isnan(x) && !std::isnan(top))) {
        best = v;
        top = x;
      }
      if (std::isnan(top)) break;  // torch.argmax: a NaN is the maximum, its first occurrence
    }
    op[b] = best;
  }
  return out;
}

// The pieces a whole layer (`dense_layer`, `decode_layer`) shares, in the Python layers' order of ops:
// q, k, v of x (rms_norm, the fused qkv linear with its bias if any (Qwen2's), qk_norm_rope) ...
std::tuple<at::Tensor, at::Tensor, at::Tensor> layer_qkv(
    const at::Tensor& x, const at::Tensor& ln1, double eps, const at::Tensor& qkv_w,
    const c10::optional<at::Tensor>& qkv_b, const c10::optional<at::Tensor>& q_norm,
    const c10::optional<at::Tensor>& k_norm, double qk_eps, const at::Tensor& cos, const at::Tensor& sin,
    int64_t heads, int64_t kv_heads, int64_t head_dim) {
  check_cpu_f32(x, "x");
  TORCH_CHECK(x.dim() == 3, "omnimesh kernel: a fused layer takes x (B, T, H), got ", x.sizes());
  return qk_norm_rope(at::linear(rms_norm(x, ln1, eps), qkv_w, qkv_b), heads, kv_heads, head_dim, q_norm, k_norm,
                      qk_eps, cos, sin);
}

// ... the attention output o (B, h, T, D) through o_proj onto the residual x ...
at::Tensor attention_residual(const at::Tensor& x, const at::Tensor& o, const at::Tensor& o_w) {
  return x + at::linear(o.transpose(1, 2).reshape({x.size(0), x.size(1), -1}), o_w);
}

// ... and the dense silu MLP of the post-attention norm (what ParallelMLP computes).
at::Tensor dense_mlp(const at::Tensor& n2, const at::Tensor& gate_up_w, const at::Tensor& down_w) {
  return at::linear(silu_mul(at::linear(n2, gate_up_w)), down_w);
}

// One dense pre-norm decoder layer over a small contiguous cache (the talker's code predictor), composed of the
// kernels above and aten's linear in the order the Python layer calls them (the same values bit for bit): no
// Python between its 11 ops. past_k / past_v (B, kv, S0, D) or none; returns y (B, T, H) and the keys / values
// (B, kv, S0 + T, D) the cache keeps. The caller checks the attention is small (T x S) and the layer has no
// o / MLP bias and one tensor-parallel rank (a q/k/v bias, `qkv_b`, is added by the qkv linear).
std::tuple<at::Tensor, at::Tensor, at::Tensor> dense_layer(
    const at::Tensor& x, const at::Tensor& ln1, const at::Tensor& qkv_w, const c10::optional<at::Tensor>& qkv_b,
    const c10::optional<at::Tensor>& q_norm,
    const c10::optional<at::Tensor>& k_norm, double qk_eps, const at::Tensor& cos, const at::Tensor& sin,
    const c10::optional<at::Tensor>& past_k, const c10::optional<at::Tensor>& past_v, const at::Tensor& o_w,
    const at::Tensor& ln2, const at::Tensor& gate_up_w, const at::Tensor& down_w, double eps, int64_t heads,
    int64_t kv_heads, int64_t head_dim, int64_t window, double scale) {
  TORCH_CHECK(past_k.has_value() == past_v.has_value(), "omnimesh kernel: give both past keys and values or none");
  auto [q, k, v] = layer_qkv(x, ln1, eps, qkv_w, qkv_b, q_norm, k_norm, qk_eps, cos, sin, heads, kv_heads, head_dim);
  if (past_k.has_value()) {
    k = at::cat({*past_k, k}, 2);
    v = at::cat({*past_v, v}, 2);
  }
  const int64_t S = k.size(2), T = x.size(1);
  at::Tensor h = attention_residual(x, attention(q, k, v, S - T, 0, window, scale), o_w);
  return {h + dense_mlp(rms_norm(h, ln2, eps), gate_up_w, down_w), k, v};
}

// One decoder layer of a decode-only batched step (the thinker's and talker's LM: every request one new token),
// composed like `dense_layer`: rms_norm, linear, qk_norm_rope, paged_decode into the pools, linear, then the
// MoE kernel (router given: gate_up / down are the experts') or the dense silu MLP (gate_up / down its
// weights), each residual added as the Python layer adds it (the same values bit for bit). x (1, N, H).
at::Tensor decode_layer(
    const at::Tensor& x, const at::Tensor& ln1, const at::Tensor& qkv_w, const c10::optional<at::Tensor>& qkv_b,
    const c10::optional<at::Tensor>& q_norm,
    const c10::optional<at::Tensor>& k_norm, double qk_eps, const at::Tensor& cos, const at::Tensor& sin,
    at::Tensor k_pool, at::Tensor v_pool, const at::Tensor& write_slots, const at::Tensor& rows,
    const at::Tensor& slots, const at::Tensor& lens, double scale, const at::Tensor& o_w, const at::Tensor& ln2,
    double eps, int64_t heads, int64_t kv_heads, int64_t head_dim, const c10::optional<at::Tensor>& router,
    const at::Tensor& gate_up, const at::Tensor& down, int64_t top_k, bool norm_topk,
    const c10::optional<at::Tensor>& shared_gate_up, const c10::optional<at::Tensor>& shared_down,
    const c10::optional<at::Tensor>& shared_gate) {
  TORCH_CHECK(x.dim() == 3 && x.size(0) == 1, "omnimesh kernel: decode_layer takes x (1, N, H), got ", x.sizes());
  auto [q, k, v] = layer_qkv(x, ln1, eps, qkv_w, qkv_b, q_norm, k_norm, qk_eps, cos, sin, heads, kv_heads, head_dim);
  at::Tensor o = at::empty(q.sizes(), q.options());
  paged_decode(q, k, v, k_pool, v_pool, write_slots, rows, slots, lens, scale, o);
  at::Tensor h = attention_residual(x, o, o_w);
  at::Tensor n2 = rms_norm(h, ln2, eps);
  at::Tensor mlp = router.has_value()
      ? moe(n2.reshape({-1, n2.size(-1)}), *router, gate_up, down, top_k, norm_topk, shared_gate_up, shared_down,
            shared_gate).reshape(n2.sizes())
      : dense_mlp(n2, gate_up, down);
  return h + mlp;
}

}  // namespace

TORCH_LIBRARY(omnimesh, m) {
  m.def("rms_norm(Tensor x, Tensor? weight, float eps) -> Tensor");
  m.def("qk_norm_rope(Tensor qkv, int heads, int kv_heads, int head_dim, Tensor? q_weight, Tensor? k_weight, "
        "float eps, Tensor cos, Tensor sin) -> (Tensor, Tensor, Tensor)");
  m.def("mrope(Tensor positions, Tensor inv_freq, int section_h, int section_w) -> (Tensor, Tensor)");
  m.def("attention(Tensor q, Tensor k, Tensor v, int q_start, int k_start, int window, float scale) -> Tensor");
  m.def("paged_decode(Tensor q, Tensor k, Tensor v, Tensor(a!) k_pool, Tensor(b!) v_pool, Tensor write_slots, "
        "Tensor rows, Tensor slots, Tensor lens, float scale, Tensor(c!) out) -> ()");
  m.def("silu_mul(Tensor x) -> Tensor");
  m.def("snake(Tensor x, Tensor alpha, Tensor inv_beta) -> Tensor");
  m.def("greedy_pick(Tensor logits, Tensor history, Tensor offsets, float penalty, Tensor? suppress) -> Tensor");
  m.def("moe(Tensor h, Tensor router, Tensor gate_up, Tensor down, int top_k, bool norm_topk, Tensor? shared_gate_up, "
        "Tensor? shared_down, Tensor? shared_gate) -> Tensor");
  m.def("dense_layer(Tensor x, Tensor ln1, Tensor qkv_w, Tensor? qkv_b, Tensor? q_norm, Tensor? k_norm, float qk_eps, Tensor cos, "
        "Tensor sin, Tensor? past_k, Tensor? past_v, Tensor o_w, Tensor ln2, Tensor gate_up_w, Tensor down_w, "
        "float eps, int heads, int kv_heads, int head_dim, int window, float scale) -> (Tensor, Tensor, Tensor)");
  m.def("decode_layer(Tensor x, Tensor ln1, Tensor qkv_w, Tensor? qkv_b, Tensor? q_norm, Tensor? k_norm, float qk_eps, Tensor cos, "
        "Tensor sin, Tensor(a!) k_pool, Tensor(b!) v_pool, Tensor write_slots, Tensor rows, Tensor slots, Tensor lens, "
        "float scale, Tensor o_w, Tensor ln2, float eps, int heads, int kv_heads, int head_dim, Tensor? router, "
        "Tensor gate_up, Tensor down, int top_k, bool norm_topk, Tensor? shared_gate_up, Tensor? shared_down, "
        "Tensor? shared_gate) -> Tensor");
}

TORCH_LIBRARY_IMPL(omnimesh, CPU, m) {
  m.impl("rms_norm", &rms_norm);
  m.impl("qk_norm_rope", &qk_norm_rope);
  m.impl("mrope", &mrope);
  m.impl("attention", &attention);
  m.impl("paged_decode", &paged_decode);
  m.impl("silu_mul", &silu_mul);
  m.impl("snake", &snake);
  m.impl("greedy_pick", &greedy_pick);
  m.impl("moe", &moe);
  m.impl("dense_layer", &dense_layer);
  m.impl("decode_layer", &decode_layer);
}
