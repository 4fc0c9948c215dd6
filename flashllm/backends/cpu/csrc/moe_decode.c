/* The mixture-of-experts MLP of a decode step's layer (Mixtral, Qwen2-MoE) inside decode_stack.c's
 * one native call, so a MoE model's decode step makes no Python op calls either.
 *
 * Per token, what flashllm/models/layers/moe.py's SparseMoeBlock computes through the ops:
 *   p = softmax(x Wr^T) over the E experts; the k largest (a lower expert id first among equals),
 *   their weights divided by their sum where renormalize is set;
 *   out = sum_j w_j down_e(silu(gate_e(x)) * up_e(x)) over the chosen experts e = ids[j]
 *       (+ sigmoid(x Wsg^T) * the shared expert's gated MLP of x; without a shared gate, unscaled).
 * DeepSeek's routing (flashllm/models/deepseek_moe.py) adds: sigmoid scores, chosen by score + bias
 * but weighed by the score; the k chosen within the topk_group best of n_group groups (a group's
 * score its best expert's for softmax, its best two's sum for sigmoid); weights times `scaling`.
 * The experts run in the order the cpu fused_moe kernel runs them (backends/cpu/moe.py): one token
 * takes its experts in slot order; several tokens go expert by expert (ascending ids), each chosen
 * expert's weights read once for all the tokens routed to it. Unchosen experts are never read.
 * Every product is flashllm_stack_linear, the kernel the per-op path runs (fp32, or int8 / int4
 * codes against fp32 activations; experts kept as a GGUF file's blocks: each expert's own descriptor,
 * as the dense layers' quant_matmul runs it), split over the step's threads where the dense stack's rule
 * says; the routing indices are computed here, so they are in range by construction.
 */
#include <math.h>
#include <stdint.h>
#include <string.h>

#include "decode_kernels.h"
#include "decode_stack.h"

struct stack_moe {
    int64_t E, k, renormalize, I;   /* experts, experts a token, renormalize the k weights, intermediate */
    int64_t kind, G13, G2;          /* experts' LINEAR_F32 / W8 / W4 layout; scale groups of w13 and w2 rows */
    const void *w13, *w2;           /* (E, 2I, H) gate rows then up rows, and (E, H, I), in kind's layout */
    const float *s13, *s2;          /* (E, 2I, G13) and (E, H, G2) scales, integer kinds */
    const stack_linear *router;     /* (E, H) */
    const stack_linear *shared_gate_up, *shared_down, *shared_gate;  /* all NULL: no shared expert */
    float *scratch;                 /* flashllm_moe_scratch(this, max_tokens, H) floats */
    int64_t max_tokens, H;
    int64_t sigmoid, n_group, topk_group;  /* sigmoid scores (else softmax); groups (1: none), groups kept */
    const float *bias;              /* (E,) added to the scores (sigmoid, or softmax probabilities) to choose experts, or NULL */
    float scaling;                  /* the k weights are multiplied by it (1 for Mixtral / Qwen2-MoE) */
    const stack_linear *blocks13, *blocks2;  /* (E,) each expert's w13 / w2 descriptor in place of w13 / w2
                                                (a GGUF file's blocks, any kind the dense layers take), or NULL */
};

#define MOE_MAX_GROUPS 64  /* moe_stack.py refuses more */

static int64_t widest_inner(const stack_moe *m) {
    return m->shared_down && m->shared_down->K > m->I ? m->shared_down->K : m->I;
}

/* Floats of scratch the block needs for T tokens (the caller allocates them, 8-byte aligned). */
int64_t flashllm_moe_scratch(const stack_moe *m, int64_t T) {
    const int64_t inner = widest_inner(m), wide = (inner > m->H ? inner : m->H) + 1;
    /* int64 ids (k a token), routed rows and their slots (one each; two floats an int64), weights,
     * logits and the scores experts are chosen by, the shared gate, three (T, H) rows, gate_up and its
     * activation, then even / odd */
    return T * (2 * m->k + 4 + m->k + 2 * m->E + 1 + 3 * m->H + 3 * inner + 2 * (wide / 2 + 1));
}

int flashllm_moe_takes(const stack_moe *m, int64_t T) {
    return T >= 1 && T <= m->max_tokens;
}

/* Whether a ranks above b: larger, with a NaN above any number (torch.topk's order). */
static int ranks_above(float a, float b) {
    return (isnan(a) && !isnan(b)) || a > b;
}

static float sigmoid_of(float v) {
    return 1.0f / (1.0f + expf(-v));
}

/* Group g's score among the experts' choice scores c: its best's (softmax), its best two's sum (sigmoid). */
static float group_score(const stack_moe *m, const float *c, int64_t g) {
    const int64_t size = m->E / m->n_group;
    const float *v = c + g * size;
    int64_t first = 0;
    for (int64_t e = 1; e < size; e++)
        if (ranks_above(v[e], v[first])) first = e;
    if (!m->sigmoid || size < 2) return v[first];
    int64_t second = first == 0 ? 1 : 0;
    for (int64_t e = 0; e < size; e++)
        if (e != first && ranks_above(v[e], v[second])) second = e;
    return v[first] + v[second];
}

/* Token t's k experts and their weights from its router logits l (E); c (E) scratch: the scores the
 * experts are chosen by (the logits themselves for softmax without a bias, which orders them alike; with
 * one, the probabilities plus the bias), -inf outside the groups kept. */
static void route(const stack_moe *m, const float *l, float *c, int64_t *ids, float *weights) {
    float top = l[0];
    for (int64_t e = 1; e < m->E; e++)
        if (ranks_above(l[e], top)) top = l[e];
    double sum = 0.0;
    if (!m->sigmoid)
        for (int64_t e = 0; e < m->E; e++) sum += expf(l[e] - top);
    for (int64_t e = 0; e < m->E; e++) {
        const float b = m->bias ? m->bias[e] : 0.0f;
        if (m->sigmoid) c[e] = sigmoid_of(l[e]) + b;
        else c[e] = m->bias ? (float)(expf(l[e] - top) / sum) + b : l[e];  /* ERNIE 4.5: probability + bias */
    }
    if (m->n_group > 1) {
        const int64_t size = m->E / m->n_group;
        float scores[MOE_MAX_GROUPS];
        for (int64_t g = 0; g < m->n_group; g++) scores[g] = group_score(m, c, g);
        for (int64_t g = 0; g < m->n_group; g++) {
            int64_t above = 0;  /* groups ranked above g: it is kept among the topk_group best */
            for (int64_t o = 0; o < m->n_group; o++)
                above += o != g && (ranks_above(scores[o], scores[g]) || (scores[o] == scores[g] && o < g));
            if (above >= m->topk_group)
                for (int64_t e = 0; e < size; e++) c[g * size + e] = -INFINITY;
        }
    }
    float picked = 0.0f;
    for (int64_t j = 0; j < m->k; j++) {
        int64_t best = -1;
        for (int64_t e = 0; e < m->E; e++) {
            int taken = 0;
            for (int64_t i = 0; i < j && !taken; i++) taken = ids[i] == e;
            if (!taken && (best < 0 || ranks_above(c[e], c[best]))) best = e;
        }
        ids[j] = best;
        weights[j] = m->sigmoid ? sigmoid_of(l[best]) : (float)(expf(l[best] - top) / sum);
        picked += weights[j];
    }
    if (m->renormalize)
        for (int64_t j = 0; j < m->k; j++) weights[j] /= picked;
    if (m->scaling != 1.0f)
        for (int64_t j = 0; j < m->k; j++) weights[j] *= m->scaling;
}

/* Expert e's w13 (which = 0) or w2 (1) as a linear-layer descriptor. */
static stack_linear expert_linear(const stack_moe *m, int64_t e, int which) {
    const int64_t N = which ? m->H : 2 * m->I, K = which ? m->I : m->H, G = which ? m->G2 : m->G13;
    const int64_t row_bytes = m->kind == LINEAR_F32 ? 4 * K : m->kind == LINEAR_W8 ? K : K / 2;
    const char *base = which ? m->w2 : m->w13;
    const float *scales = which ? m->s2 : m->s13;
    stack_linear l = {m->kind, N, K, G, base + e * N * row_bytes, scales ? scales + e * N * G : NULL,
                      NULL, NULL, NULL, NULL};
    return l;
}

static int threads_for(const stack_linear *l, const moe_sizes *z) {
    return l->N * l->K >= z->split_elements ? z->threads : 1;
}

/* y (n, H) = the gated MLP of x (n, H) through gate_up (2I', H) and down (H, I') */
static void gated_mlp(const stack_linear *gate_up, const stack_linear *down, const moe_sizes *z, int64_t n,
                      const float *x, float *y, float *gu, float *act, float *even, float *odd) {
    const int64_t inner = down->K;
    flashllm_stack_linear(gate_up, n, threads_for(gate_up, z), x, gu, even, odd);
    flashllm_silu_and_mul_mt(gu, act, n, inner, n * inner >= z->silu_split ? z->threads : 1);
    flashllm_stack_linear(down, n, threads_for(down, z), act, y, even, odd);
}

void flashllm_moe_block(const stack_moe *m, const moe_sizes *z, const float *x, float *out) {
    const int64_t T = z->T, H = z->H, k = m->k, inner = widest_inner(m);
    const int64_t wide = (inner > H ? inner : H) + 1;
    int64_t *ids = (int64_t *)m->scratch, *rows = ids + T * k, *slots = rows + T;
    float *weights = (float *)(slots + T), *logits = weights + T * k, *choice = logits + T * m->E;
    float *gate = choice + T * m->E;
    float *acc = gate + T, *xg = acc + T * H, *y = xg + T * H, *gu = y + T * H, *act = gu + 2 * T * inner;
    float *even = act + T * inner, *odd = even + T * (wide / 2 + 1);
    flashllm_stack_linear(m->router, T, threads_for(m->router, z), x, logits, even, odd);
    for (int64_t t = 0; t < T; t++) route(m, logits + t * m->E, choice + t * m->E, ids + t * k, weights + t * k);
    memset(acc, 0, (size_t)(T * H) * sizeof(float));
    /* one token: its experts in slot order; several: expert by expert, the tokens routed to each gathered */
    const int64_t units = T == 1 ? k : m->E;
    for (int64_t u = 0; u < units; u++) {
        int64_t expert = u, n = 0;
        if (T == 1) {
            expert = ids[u];
            rows[0] = 0;
            slots[0] = u;
            n = 1;
        } else {
            for (int64_t t = 0; t < T; t++)
                for (int64_t j = 0; j < k; j++)
                    if (ids[t * k + j] == u) {
                        rows[n] = t;
                        slots[n++] = t * k + j;
                    }
            if (n == 0) continue;
            for (int64_t i = 0; i < n; i++) memcpy(xg + i * H, x + rows[i] * H, (size_t)H * sizeof(float));
        }
        const stack_linear w13 = m->blocks13 ? m->blocks13[expert] : expert_linear(m, expert, 0);
        const stack_linear w2 = m->blocks2 ? m->blocks2[expert] : expert_linear(m, expert, 1);
        gated_mlp(&w13, &w2, z, n, T == 1 ? x : xg, y, gu, act, even, odd);
        for (int64_t i = 0; i < n; i++) {
            const float w = weights[slots[i]];
            float *a = acc + rows[i] * H;
            const float *yi = y + i * H;
            for (int64_t h = 0; h < H; h++) a[h] += yi[h] * w;
        }
    }
    if (!m->shared_gate_up) {
        memcpy(out, acc, (size_t)(T * H) * sizeof(float));
        return;
    }
    gated_mlp(m->shared_gate_up, m->shared_down, z, T, x, y, gu, act, even, odd);
    if (m->shared_gate) flashllm_stack_linear(m->shared_gate, T, 1, x, gate, even, odd);
    for (int64_t t = 0; t < T; t++) {
        if (!m->shared_gate) {  /* DeepSeek's shared experts: added as they are */
            for (int64_t h = 0; h < H; h++) out[t * H + h] = acc[t * H + h] + y[t * H + h];
            continue;
        }
        const float g = 1.0f / (1.0f + expf(-gate[t]));
        for (int64_t h = 0; h < H; h++) out[t * H + h] = acc[t * H + h] + g * y[t * H + h];
    }
}
