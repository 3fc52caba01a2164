/* batchgen: a decode step's decoder layers in one C call (float32, bfloat16 or float16 rows).
 *
 * Why: at batch 1 the C kernels of a decoder layer take about 1.2 ms on a 1B model, and the
 * Python between them (nine calls through ctypes, their checks, torch's temporaries) took
 * 0.25 ms more a layer, a fifth of the step; the weights streaming through the caches between
 * two calls evict the interpreter's own lines, so each call costs several times what it costs
 * alone. This file holds no arithmetic of its own but the residual add: it calls the same
 * kernels, with the same arguments, in the order the Python layers call them
 * (engine/fused_decoder.py's FusedDecoderLayer over FusedRMSNorm, FusedAttention and
 * FusedGatedMLP), so every bit is theirs. The kernels live in other libraries (quant.c,
 * linear.c, fused.c, paged_attention.c), each built for its own ISA; kernels/cpu/decoder.py
 * hands their addresses over in `struct bg_entry` and checks, once, that every layer is of the
 * shape this program runs.
 *
 * A layer, for m rows of hidden states h (the residual stream, updated in place):
 *   a = rms_norm(h, norm1)            [m, H]
 *   q = qkv(a)                        [m, W]   (W = (heads + 2 kv_heads) d, one or more parts)
 *   (Qwen3: each query and key head through its RMSNorm, in place)
 *   rope_cache(q, cos, sin, cache)             (the query and key heads rotated in place, K/V
 *                                               written to the paged cache)
 *   t = attention(q's query heads)    [m, heads d]  (decode rows: one query per sequence)
 *   o = o_proj(t)                     [m, H]
 *   (Gemma: o = rms_norm(o, attn_out_norm))
 *   s = h + o, a = rms_norm(s, norm2)          (one pass: add_rms_norm)
 *   g = gate_up(a)                    [m, 2 I]
 *   u = act(g[:, :I]) * g[:, I:]      [m, I]   (act: SiLU, or Gemma's GELU-tanh)
 *   d = down(u)                                (Gemma: d = rms_norm(d, mlp_out_norm))
 *   h = s + d
 */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

/* The entry points of the other kernel libraries (their signatures, as exported). */
struct bg_entry {
  int (*quant_linear)(const float *x, int64_t ldx, int64_t m, int64_t k, const uint8_t *packed,
                      int qtype, int64_t n, const float *bias, float *y, int64_t ldy);
  void (*linear_f32)(const float *x, int64_t ldx, const float *packed, const float *bias, float *y,
                     int64_t ldy, int64_t m, int64_t n, int64_t k);
  void (*rms_norm)(const float *x, int64_t ldx, const float *w, float *y, int64_t ldy, int64_t m,
                   int64_t n, float eps);
  void (*add_rms_norm)(const float *x, int64_t ldx, const float *h, int64_t ldh, const float *w,
                       float *s, float *y, int64_t m, int64_t n, float eps);
  void (*gated_mul)(const float *gu, int64_t ldgu, float *y, int64_t ldy, int64_t m, int64_t n, int act);
  int (*rope_cache)(void *qkv, int64_t ld, const void *cos, int64_t ldc, const void *sin,
                    int64_t lds, void *k_cache, void *v_cache, const int64_t *slots,
                    int64_t num_slots, int64_t m, int64_t heads, int64_t kv_heads, int64_t d,
                    int dtype, int kv_dtype);
  int (*attention)(void *out, const void *query, const void *k_cache, const void *v_cache,
                   const int32_t *block_tables, const int32_t *query_start_loc,
                   const int32_t *context_lens, int64_t num_seqs, int64_t num_tokens,
                   int64_t num_kv_heads, int64_t block_size, int64_t max_blocks,
                   int64_t q_stride_tok, int64_t q_stride_head, float scale, int64_t num_blocks,
                   int dtype, int kv_dtype, int64_t sliding_window, float logits_soft_cap);
  /* bfloat16 / float16 rows (dtype 1 / 2): the same ops' 16-bit entry points, and torch's add */
  int (*linear_16)(const uint16_t *x, int64_t ldx, const uint16_t *packed, const float *bias,
                   uint16_t *y, int64_t ldy, int64_t m, int64_t n, int64_t k, int dtype);
  void (*rms_norm_16)(const uint16_t *x, int64_t ldx, const void *w, uint16_t *y, int64_t ldy,
                      int64_t m, int64_t n, float eps, int dtype);
  void (*add_rms_norm_16)(const uint16_t *x, int64_t ldx, const uint16_t *h, int64_t ldh,
                          const void *w, uint16_t *s, uint16_t *y, int64_t m, int64_t n,
                          float eps, int dtype);
  void (*gated_mul_16)(const uint16_t *gu, int64_t ldgu, uint16_t *y, int64_t ldy, int64_t m,
                       int64_t n, int dtype, int act);
  void (*add_16)(const uint16_t *x, const uint16_t *h, uint16_t *s, int64_t m, int64_t n, int dtype);
};

/* One part of a linear layer: `n` output columns at column `offset` of the layer's output.
 * kind 0: a float32 PackedLinear (linear.c's panels, bias padded); 1: GGUF blocks (quant.c's
 * panels, `qtype` its kernel id; float32 rows only); 2: a 16-bit PackedLinear of the rows'
 * dtype. A layer of several parts is a ConcatLinear. */
#define BG_MAX_PARTS 4
struct bg_part {
  const void *weight;
  const float *bias;
  int64_t n, offset;
  int32_t kind, qtype;
};
struct bg_linear {
  int64_t k, n, parts;
  struct bg_part part[BG_MAX_PARTS];
};

struct bg_layer {
  const void *norm1, *norm2; /* the rows' dtype */
  float eps1, eps2;
  const void *q_norm, *k_norm; /* per-head RMSNorms of the query and key heads (Qwen3), or NULL */
  float q_eps, k_eps;
  const void *attn_out_norm, *mlp_out_norm; /* Gemma's norms of the two outputs, or NULL */
  float attn_out_eps, mlp_out_eps;
  int32_t act;  /* fused.c's ACT_* code of the MLP's gate */
  int32_t rope; /* which of the step's cos / sin tables the layer rotates by */
  struct bg_linear qkv, o, gate_up, down;
  int64_t heads, kv_heads, head_dim;
  float scale, soft_cap;
  int64_t window;
  void *k_cache, *v_cache; /* this layer's pools [num_blocks, block_size, kv_heads, d] */
  int64_t num_blocks, block_size;
  int32_t kv_dtype; /* kernels' dtype code of the cache (0 float32) */
  int32_t norm_flags; /* or'ed into a 16-bit step's dtype code for this layer's norms: fused.c's W_F32
                        where every norm's weight is float32 (Gemma's 1 + w), else 0 */
};

/* The step: m decode rows, one per sequence, of `dtype` (0 float32, 1 bfloat16, 2 float16:
 * the hidden states, the norms' weights, cos / sin and every intermediate). */
#define BG_MAX_ROPES 4
struct bg_step {
  int64_t m;
  int64_t dtype;
  const void *cos[BG_MAX_ROPES], *sin[BG_MAX_ROPES]; /* [m, d] each: one table per layer type */
  int64_t ldc, lds;
  const int64_t *slots;   /* [m] */
  const int32_t *tables;  /* [m, max_blocks] */
  const int32_t *lens;    /* [m] */
  int64_t max_blocks;
};

/* Where a failure came from (`*where` on a non-zero return). */
enum { AT_QKV = 1, AT_O, AT_GATE_UP, AT_DOWN, AT_ROPE, AT_ATTENTION, AT_MEMORY };

/* y = x Wᵀ (+ b) for every part, rows of dtype; 0, or the first part's non-zero status. */
static int run_linear(const struct bg_entry *e, const struct bg_linear *l, const void *x, int64_t m,
                      void *y, int dtype) {
  for (int64_t p = 0; p < l->parts; ++p) {
    const struct bg_part *q = &l->part[p];
    int rc = 0;
    if (q->kind == 1)
      rc = e->quant_linear(x, l->k, m, l->k, q->weight, q->qtype, q->n, q->bias, (float *)y + q->offset, l->n);
    else if (q->kind == 2)
      rc = e->linear_16(x, l->k, q->weight, q->bias, (uint16_t *)y + q->offset, l->n, m, q->n, l->k, dtype);
    else
      e->linear_f32(x, l->k, q->weight, q->bias, (float *)y + q->offset, l->n, m, q->n, l->k);
    if (rc) return rc;
  }
  return 0;
}

/* The dtype code of layer L's norms in a step of `dtype` (0 float32) */
static int norm_code(const struct bg_layer *L, int dtype) { return dtype ? dtype | L->norm_flags : dtype; }

static void rms_norm(const struct bg_entry *e, const void *x, const void *w, void *y, int64_t m, int64_t n,
                     float eps, int dtype) {
  if (dtype) e->rms_norm_16(x, n, w, y, n, m, n, eps, dtype);
  else e->rms_norm(x, n, w, y, n, m, n, eps);
}

/* The per-head q and k norms of token rows q ([m, W]), in place through tmp ([h d] per token):
 * the Python layer's `q.copy_(q_norm(q.contiguous()))`, each head a row of d. */
static void norm_heads(const struct bg_entry *e, const struct bg_layer *L, const struct bg_step *s, char *q,
                       char *tmp) {
  const int64_t d = L->head_dim, W = L->qkv.n, es = s->dtype ? 2 : 4;
  for (int64_t i = 0; i < s->m; ++i) {
    char *row = q + es * i * W;
    rms_norm(e, row, L->q_norm, tmp, L->heads, d, L->q_eps, norm_code(L, (int)s->dtype));
    memcpy(row, tmp, (size_t)(es * L->heads * d));
    row += es * L->heads * d;
    rms_norm(e, row, L->k_norm, tmp, L->kv_heads, d, L->k_eps, norm_code(L, (int)s->dtype));
    memcpy(row, tmp, (size_t)(es * L->kv_heads * d));
  }
}

/* The attention half: h's norm, q/k/v, RoPE and the cache write, attention, o_proj into `o`
 * (then its norm, through `a`, in the sandwich form). Returns 0, or a status with *where set. */
static int attention_half(const struct bg_entry *e, const struct bg_layer *L, const struct bg_step *s,
                          const void *h, void *a, void *q, void *t, void *o, int *where) {
  const int64_t m = s->m, H = L->qkv.k, W = L->qkv.n, d = L->head_dim;
  const int dt = (int)s->dtype;
  int rc;
  rms_norm(e, h, L->norm1, a, m, H, L->eps1, norm_code(L, dt));
  if ((rc = run_linear(e, &L->qkv, a, m, q, dt))) return *where = AT_QKV, rc;
  if (L->q_norm) norm_heads(e, L, s, q, t); /* t: the attention's output, not written yet */
  rc = e->rope_cache(q, W, s->cos[L->rope], s->ldc, s->sin[L->rope], s->lds, L->k_cache, L->v_cache, s->slots,
                     L->num_blocks * L->block_size, m, L->heads, L->kv_heads, d, dt, L->kv_dtype);
  if (rc) return *where = AT_ROPE, rc;
  rc = e->attention(t, q, L->k_cache, L->v_cache, s->tables, NULL, s->lens, m, m, L->kv_heads,
                    L->block_size, s->max_blocks, W, d, L->scale, L->num_blocks, dt, L->kv_dtype,
                    L->window, L->soft_cap);
  if (rc) return *where = AT_ATTENTION, rc;
  if ((rc = run_linear(e, &L->o, t, m, o, dt))) return *where = AT_O, rc;
  if (L->attn_out_norm) {
    rms_norm(e, o, L->attn_out_norm, a, m, H, L->attn_out_eps, norm_code(L, dt));
    memcpy(o, a, (size_t)(m * H * (dt ? 2 : 4)));
  }
  return 0;
}

/* The MLP half: s = h + o, a = rms_norm(s), then h = s + down(act(gate) * up) (the down
 * projection's output through its norm first, in the sandwich form: `o` is free by then). */
static int mlp_half(const struct bg_entry *e, const struct bg_layer *L, const struct bg_step *st, void *h,
                    void *o, void *a, void *sum, void *g, void *u, void *dn, int *where) {
  const int64_t m = st->m, H = L->qkv.k, G = L->gate_up.n, I = G / 2;
  const int dt = (int)st->dtype;
  int rc;
  if (dt) e->add_rms_norm_16(h, H, o, H, L->norm2, sum, a, m, H, L->eps2, norm_code(L, dt));
  else e->add_rms_norm(h, H, o, H, L->norm2, sum, a, m, H, L->eps2);
  if ((rc = run_linear(e, &L->gate_up, a, m, g, dt))) return *where = AT_GATE_UP, rc;
  if (dt) e->gated_mul_16(g, G, u, I, m, I, dt, L->act);
  else e->gated_mul(g, G, u, I, m, I, L->act);
  if ((rc = run_linear(e, &L->down, u, m, dn, dt))) return *where = AT_DOWN, rc;
  if (L->mlp_out_norm) {
    rms_norm(e, dn, L->mlp_out_norm, o, m, H, L->mlp_out_eps, norm_code(L, dt));
    dn = o;
  }
  if (dt) {
    e->add_16(sum, dn, h, m, H, dt); /* torch's residual.add_(mlp) in the 16-bit type */
  } else {
    float *hf = h;
    const float *sf = sum, *df = dn;
    for (int64_t j = 0; j < m * H; ++j) hf[j] = sf[j] + df[j]; /* torch's residual.add_(mlp) */
  }
  return 0;
}

/* Runs layers [0, n_layers) over h ([m, H] contiguous rows of the step's dtype, updated in
 * place). Returns 0; or the failing kernel's status, with *where (AT_*) and *layer set: h is
 * then partly updated and the step must not be used. The scratch is malloc'd per call (about
 * 10 rows of the widest layer). */
int batchgen_decoder_run(const struct bg_entry *e, const struct bg_layer *layers, int64_t n_layers,
                         const struct bg_step *s, void *h, int *where, int64_t *layer) {
  if (n_layers <= 0 || s->m <= 0) return 0;
  const int64_t m = s->m, H = layers[0].qkv.k, es = s->dtype ? 2 : 4;
  int64_t W = 0, T = 0, G = 0;
  for (int64_t i = 0; i < n_layers; ++i) {
    const struct bg_layer *L = &layers[i];
    if (L->qkv.n > W) W = L->qkv.n;
    if (L->heads * L->head_dim > T) T = L->heads * L->head_dim;
    if (L->gate_up.n > G) G = L->gate_up.n;
  }
  char *buf = malloc((size_t)(es * m * (4 * H + W + T + G + G / 2)));
  if (!buf) return *where = AT_MEMORY, *layer = 0, -1;
  char *a = buf, *o = a + es * m * H, *sum = o + es * m * H, *dn = sum + es * m * H, *q = dn + es * m * H;
  char *t = q + es * m * W, *g = t + es * m * T, *u = g + es * m * G;
  int rc = 0;
  for (int64_t i = 0; i < n_layers && !rc; ++i) {
    *layer = i;
    rc = attention_half(e, &layers[i], s, h, a, q, t, o, where);
    if (!rc) rc = mlp_half(e, &layers[i], s, h, o, a, sum, g, u, dn, where);
  }
  free(buf);
  return rc;
}

/* The struct sizes, so that decoder.py can check its ctypes mirrors against this build. */
int64_t batchgen_decoder_sizes(int which) {
  switch (which) {
    case 0: return (int64_t)sizeof(struct bg_entry);
    case 1: return (int64_t)sizeof(struct bg_layer);
    case 2: return (int64_t)sizeof(struct bg_step);
    default: return -1;
  }
}
