/* A whole decode step of a Llama-family decoder stack in one native call.
 *
 * At batch 1 every layer makes ~12 op calls from Python (norms, three projections' wrappers, rotary,
 * KV write, attention, activation), ~0.3 ms of interpreter and ctypes work per layer on `epyc3-2c`
 * (docs/benchmarks.md): 8 ms of a 72 ms token for the 0.5b shape. This file runs the same kernels in the
 * same order for all layers of a decode step (every sequence brings one token), so the result is
 * what the per-op native path computes; flashllm/backends/cpu/decode_stack.py decides when it
 * applies, and indices_in_range checks every index before the first write.
 *
 * Per layer, with h the layer input and r the residual stream (r = h before the first layer):
 *   r += h; x = rms(r) * w_in; qkv = x Wqkv^T (+b); (norm each q, k head;) rotate q, k; cache[slot] = k, v;
 *   a = attention(q, cache); h = a Wo^T (+b); r += h; x = rms(r) * w_post;
 *   h = down(silu(gate(x)) * up(x)) (+b)    (or a mixture of experts, moe_decode.c)
 * (the attention, from qkv to h = a Wo^T, may instead be DeepSeek's latent attention, mla_decode.c)
 * and after the last layer out = rms(h + r) * w_final. With taps, r entering the tapped layers is kept too.
 */
#include <stdint.h>
#include <string.h>

#include "decode_kernels.h"
#include "decode_lora.h"
#include "decode_stack.h"

typedef struct {
    stack_linear qkv, o, gate_up, down;   /* gate_up and down unused where moe is set */
    const float *input_norm, *post_norm;  /* (H,) */
    float *k_cache, *v_cache;             /* (blocks, block_size, Hk, D) fp32, contiguous */
    const stack_moe *moe;                 /* the layer's mixture-of-experts MLP, or NULL for the dense one */
    const stack_mla *mla;                 /* the layer's latent attention (qkv, o and v_cache unused; k_cache
                                           * its latent cache, Hk = 1 and D = L + R), or NULL */
    const float *q_norm, *k_norm;         /* (D,) each: every query / key head RMS-normed before the rotary
                                           * embedding (Qwen3), or NULL */
} stack_layer;

typedef struct {
    int64_t T, H, Hq, Hk, D, I, rot, neox, block_size, width;
    float eps, scale;
    const float *cos_sin;       /* (max_position, rot) */
    const int64_t *positions;   /* (T,) */
    const int64_t *slots;       /* (T,) cache slots of the new tokens */
    const int64_t *rows;        /* (T,) 0..T-1: sequence b's query row */
    const int32_t *tables;      /* (T, width) block tables */
    const int32_t *seq_lens;    /* (T,) context lengths including the new token */
    const float *final_norm;    /* (H,) */
    int threads;
    int64_t split_elements;     /* products with at least N x K of this many weights split over threads */
    int64_t attention_split;    /* attention splits from this many (sequence, head, slot) triples */
    int64_t silu_split;         /* silu_and_mul splits from this many outputs */
    int64_t num_blocks;         /* blocks in each KV cache */
    int64_t max_position;       /* rows of cos_sin */
    const int64_t *ids;         /* (T,) token ids whose embed rows start the step, or NULL (hidden holds them) */
    const float *embed;         /* (vocab, H) embedding table, read where ids is set */
    int64_t vocab;
    const int64_t *lora_slots;  /* (T,) each token's adapter slot, -1 for none; NULL: no adapters this step */
    int64_t lora_count, lora_rank;  /* the layers' adapter slots and their rank (0, 0 without adapter tables) */
    int64_t head_afmt;          /* 0, or the LM head's llama.cpp activation format (A8_*): the final states
                                 * leave rounded as the head's integer product would see them */
    const int64_t *tap_layers;  /* (num_taps,) layers whose input stream r is kept (an EAGLE-3 head reads
                                 * them), or NULL */
    int64_t num_taps;
    float *taps;                /* (T, num_taps * H): tap k's stream in columns k H .. (k + 1) H - 1 */
} stack_step;

/* Keep the stream entering layer l (r, after the input norm's residual add) where l is a tapped layer. */
static void keep_taps(const stack_step *s, int64_t l, const float *residual) {
    for (int64_t k = 0; k < s->num_taps; k++) {
        if (s->tap_layers[k] != l) continue;
        for (int64_t t = 0; t < s->T; t++)
            memcpy(s->taps + (t * s->num_taps + k) * s->H, residual + t * s->H, (size_t)s->H * sizeof(float));
    }
}

/* Whether every index the step follows is in range: each token id within the embedding table,
 * each context length within its table, each position within the rope table, each new token's slot
 * within the caches, and each block a sequence's context reads within them. Checked before anything
 * is written, here rather than in decode_stack.py, where four torch.aminmax calls and their
 * conversions cost ~80 us a batch-1 step (`intel-2c`, docs/benchmarks.md); here they cost nothing
 * measurable, and each row's table is checked only as far as its own context reaches. */
static int indices_in_range(const stack_step *s) {
    for (int64_t t = 0; t < s->T; t++) {
        if (s->ids && (s->ids[t] < 0 || s->ids[t] >= s->vocab)) return 0;
        const int64_t len = s->seq_lens[t];
        if (len < 1 || len > s->width * s->block_size) return 0;
        if (s->positions[t] < 0 || s->positions[t] >= s->max_position) return 0;
        if (s->slots[t] < 0 || s->slots[t] >= s->num_blocks * s->block_size) return 0;
        if (s->lora_slots && (s->lora_slots[t] < -1 || s->lora_slots[t] >= s->lora_count)) return 0;
        for (int64_t j = 0; j < (len + s->block_size - 1) / s->block_size; j++)
            if (s->tables[t * s->width + j] < 0 || s->tables[t * s->width + j] >= s->num_blocks) return 0;
    }
    return 1;
}

void flashllm_stack_linear(const stack_linear *l, int64_t T, int threads, const float *x, float *y, float *even,
                           float *odd) {
    if (l->kind == LINEAR_F32) {
        flashllm_f32_gemv_mt(x, l->weight, y, T, l->K, l->N, l->N, threads);
    } else if (l->kind == LINEAR_W8) {
        flashllm_w8_gemv_mt(x, T, l->K, l->weight, l->scales, l->G, y, l->N, l->N, threads);
    } else if (l->kind == LINEAR_W8A8) {  /* the scratch as for W4A8 */
        flashllm_w8a8_gemv_mt(x, T, l->K, l->weight, l->scales, l->offsets, l->G, y, l->N, l->N, even, threads,
                              (int)l->afmt);
    } else if (l->kind == LINEAR_W4A8) {  /* even, then odd: T x widest floats, more than it needs */
        flashllm_w4a8_gemv_mt(x, T, l->K, l->weight, l->scales, l->zeros, l->offsets, l->G, y, l->N, l->N, even,
                              threads, (int)l->afmt);
    } else {
        const int64_t half = l->K / 2;
        for (int64_t t = 0; t < T; t++)
            for (int64_t i = 0; i < half; i++) {
                even[t * half + i] = x[t * l->K + 2 * i];
                odd[t * half + i] = x[t * l->K + 2 * i + 1];
            }
        flashllm_w4_gemv_mt(even, odd, T, l->K, l->weight, l->scales, l->zeros, l->G, y, l->N, l->N, threads);
    }
    if (l->bias)
        for (int64_t t = 0; t < T; t++)
            for (int64_t n = 0; n < l->N; n++) y[t * l->N + n] += l->bias[n];
}

/* flashllm_stack_linear of the step's T tokens, split over its threads where the weight is large enough
 * (even / odd: T x K floats together, see there), plus each token's adapter delta; lora: decode_lora.c's
 * scratch */
static void linear(const stack_linear *l, const stack_step *s, const float *x, float *y, float *even, float *odd,
                   float *lora) {
    flashllm_stack_linear(l, s->T, l->N * l->K >= s->split_elements ? s->threads : 1, x, y, even, odd);
    flashllm_lora_apply(l->lora, s->lora_slots, s->T, x, l->K, y, l->N, lora, s->split_elements, s->threads);
}

/* The stack's own scratch floats for T tokens; decode_lora.c's follow them. */
static int64_t stack_scratch(const stack_step *s) {
    const int64_t qkv = (s->Hq + 2 * s->Hk) * s->D, widest = s->I > s->H ? s->I : s->H;
    return s->T * (s->H + qkv + s->Hq * s->D + 2 * s->I + s->I + widest);
}

/* Scratch floats flashllm_decode_stack needs for T tokens (the caller allocates them). */
int64_t flashllm_decode_stack_scratch(const stack_step *s) {
    int64_t widest = s->I > s->H ? s->I : s->H;
    widest = s->Hq * s->D > widest ? s->Hq * s->D : widest;
    return stack_scratch(s) + (s->lora_rank ? flashllm_lora_scratch(s->T, widest, s->lora_rank) : 0);
}

/* hidden (T, H): the embedded tokens in (or, with s->ids set, their rows of s->embed copied in here),
 * the final-normed hidden states out; residual (T, H) scratch. Returns 0, having written nothing,
 * where an index is out of range (indices_in_range); 1 when done. */
int flashllm_decode_stack(const stack_layer *layers, int64_t L, const stack_step *s, float *hidden,
                          float *residual, float *scratch) {
    if (!indices_in_range(s)) return 0;
    for (int64_t l = 0; l < L; l++)
        if ((layers[l].moe && !flashllm_moe_takes(layers[l].moe, s->T))
            || (layers[l].mla && !flashllm_mla_takes(layers[l].mla, s->T)))
            return 0;
    const int64_t T = s->T, H = s->H, D = s->D, qkv_width = (s->Hq + 2 * s->Hk) * D;
    if (s->ids)
        for (int64_t t = 0; t < T; t++) memcpy(hidden + t * H, s->embed + s->ids[t] * H, (size_t)H * sizeof(float));
    const int64_t widest = s->I > H ? s->I : H;
    float *x = scratch, *qkv = x + T * H, *attn = qkv + T * qkv_width, *gate_up = attn + T * s->Hq * D;
    float *act = gate_up + T * 2 * s->I, *even = act + T * s->I, *odd = even + T * widest / 2;
    float *lora = scratch + stack_scratch(s);
    const int64_t slot_floats = s->Hk * D;
    int64_t longest = 0;
    for (int64_t t = 0; t < T; t++) longest = s->seq_lens[t] > longest ? s->seq_lens[t] : longest;
    /* the per-op path's thresholds (native_ops.py); threads never change the result */
    const int attention_threads = T * s->Hq * longest >= s->attention_split ? s->threads : 1;
    const moe_sizes moe = {T, H, s->threads, s->split_elements, s->silu_split};
    const mla_sizes mla = {T, s->block_size, s->width, s->rot, s->neox, s->threads, s->split_elements,
                           s->attention_split, s->scale, s->cos_sin, s->positions, s->slots, s->rows, s->tables,
                           s->seq_lens};
    for (int64_t l = 0; l < L; l++) {
        const stack_layer *layer = layers + l;
        if (l == 0) {
            memcpy(residual, hidden, (size_t)(T * H) * sizeof(float));
            flashllm_rms_norm(hidden, NULL, NULL, layer->input_norm, x, T, H, s->eps);
        } else {
            flashllm_rms_norm(hidden, residual, residual, layer->input_norm, x, T, H, s->eps);
        }
        if (s->taps) keep_taps(s, l, residual);
        if (layer->mla) {  /* no adapters there either (decode_stack.py refuses them) */
            flashllm_mla_block(layer->mla, &mla, layer->k_cache, x, hidden);
        } else {
            linear(&layer->qkv, s, x, qkv, even, odd, lora);
            if (layer->q_norm)  /* in place, one head of D a row, as the per-op path's rms_norm of (T Hq, D) */
                for (int64_t t = 0; t < T; t++) {
                    float *q = qkv + t * qkv_width, *k = q + s->Hq * D;
                    flashllm_rms_norm(q, NULL, NULL, layer->q_norm, q, s->Hq, D, s->eps);
                    flashllm_rms_norm(k, NULL, NULL, layer->k_norm, k, s->Hk, D, s->eps);
                }
            flashllm_rotary(qkv, T, qkv_width, s->Hq, D, s->rot, s->cos_sin, s->positions, (int)s->neox);
            flashllm_rotary(qkv + s->Hq * D, T, qkv_width, s->Hk, D, s->rot, s->cos_sin, s->positions, (int)s->neox);
            for (int64_t t = 0; t < T; t++) {
                const float *k = qkv + t * qkv_width + s->Hq * D, *v = k + slot_floats;
                memcpy(layer->k_cache + s->slots[t] * slot_floats, k, (size_t)slot_floats * sizeof(float));
                memcpy(layer->v_cache + s->slots[t] * slot_floats, v, (size_t)slot_floats * sizeof(float));
            }
            flashllm_decode_attention(qkv, qkv_width, layer->k_cache, layer->v_cache, s->tables, s->width, s->seq_lens,
                                      s->rows, T, s->Hq, s->Hk, D, s->block_size, s->scale, attn, attention_threads);
            linear(&layer->o, s, attn, hidden, even, odd, lora);
        }
        flashllm_rms_norm(hidden, residual, residual, layer->post_norm, x, T, H, s->eps);
        if (layer->moe) {  /* its router and shared expert carry no adapters (moe_stack.py refuses them) */
            flashllm_moe_block(layer->moe, &moe, x, hidden);
            continue;
        }
        linear(&layer->gate_up, s, x, gate_up, even, odd, lora);
        flashllm_silu_and_mul_mt(gate_up, act, T, s->I, T * s->I >= s->silu_split ? s->threads : 1);
        linear(&layer->down, s, act, hidden, even, odd, lora);
    }
    flashllm_rms_norm(hidden, residual, residual, s->final_norm, x, T, H, s->eps);
    memcpy(hidden, x, (size_t)(T * H) * sizeof(float));
    if (s->head_afmt) flashllm_round_activations(hidden, T, H, (int)s->head_afmt);  /* decode_stack.py checked H */
    return 1;
}

/* The greedy LM head a burst runs after each step: flashllm/backends/cpu/greedy_screen.py's screen
 * (scores from the head's int8 or bf16 copy) and its pick (the fp32 argmax among the rows the
 * scores' margins leave). */
typedef struct {
    int64_t int8;                            /* 1: the int8 copy (codes and row scales), 0: the bf16 one */
    const void *copy;
    const float *scales;                     /* (N,), the int8 copy's */
    int64_t N, multiplier;                   /* rows; the int8 screen's m */
    const float *weight;                     /* (N, H) the fp32 head, for the picked rows' logits */
    const float *bound;                      /* (N,) the rows' margin bounds */
    double factor[2], floor0[2], floor1[2];  /* the pick's margins; [1] for scores from the bf16 AMX tiles */
    float *scores;                           /* (T, N) */
    void *scratch;                           /* the screen's, for T tokens */
    int64_t *counts;                         /* (2,) the pick's */
    int screen_threads, pick_threads;
    const int64_t *ids;                      /* (N,) row n's token id (a drafter's vocabulary subset), or NULL: n */
} burst_head;

static int is_stop(int64_t token, const int64_t *stop_ids, int64_t num_stop) {
    for (int64_t i = 0; i < num_stop; i++)
        if (stop_ids[i] == token) return 1;
    return 0;
}

/* Up to `steps` greedy decode steps of the same sequences in one call, without returning to Python
 * between them (that return costs ~1 ms of a ~52 ms batch-1 step on `intel-2c`, all of it run cold
 * after the weights' stream). Step k runs the stack on s->ids (which must be set), then the head's
 * screen and pick on the final hidden states, and writes its T tokens to tokens + k T; for the next
 * step it moves each sequence on by one: its token into s->ids, its position and context length up
 * by one, its slot from its block table, which the caller has grown to cover every step. s->ids,
 * positions, slots and seq_lens are the caller's buffers and are changed. The burst ends after the
 * step where a token is in stop_ids, or where the pick left a token at -1 (a non-finite score or
 * logit: the caller takes that token's full logits from hidden, which holds the last step's states).
 * Returns the steps done: 0 where the first was refused (no screen path for T tokens, or an index
 * out of range), having written nothing; a later refusal just ends the burst. *picked grows by the
 * rows whose fp32 logits the picks computed.
 *
 * What a drafter reading the target's hidden states needs of each step is kept too: with `states`
 * (steps x T x H) set, step k's final states go to states + k T H; with taps (s->taps set, sized for
 * steps x T tokens), step k's tapped streams go to rows k T .. (k + 1) T - 1 of it. */
static int64_t burst_steps(const stack_layer *layers, int64_t L, stack_step *s, const burst_head *h, float *hidden,
                           float *residual, float *scratch, int64_t steps, const int64_t *stop_ids,
                           int64_t num_stop, int64_t *tokens, int64_t *picked, float *states, float *taps) {
    const int64_t T = s->T, H = s->H, bs = s->block_size;
    int64_t *ids = (int64_t *)s->ids, *positions = (int64_t *)s->positions, *slots = (int64_t *)s->slots;
    int32_t *seq_lens = (int32_t *)s->seq_lens;
    if (!ids || !(h->int8 ? flashllm_i8_screen_takes(H, h->multiplier) : flashllm_bf16_screen_takes(T))) return 0;
    for (int64_t k = 0; k < steps; k++) {
        if (taps) s->taps = taps + k * T * s->num_taps * H;
        if (!flashllm_decode_stack(layers, L, s, hidden, residual, scratch)) return k;
        if (states) memcpy(states + k * T * H, hidden, (size_t)(T * H) * sizeof(float));
        const int path = h->int8 ? flashllm_i8_screen_mt(hidden, T, H, h->copy, h->scales, h->scores, h->N, h->N,
                                                         h->multiplier, h->scratch, h->screen_threads)
                                 : flashllm_bf16_gemv_mt(hidden, h->copy, h->scores, T, H, h->N, h->N, h->scratch,
                                                         h->screen_threads);
        if (!path) return k;
        const int split = !h->int8 && path == 2;
        int64_t *out = tokens + k * T;
        flashllm_screen_pick(hidden, T, H, h->weight, h->scores, h->N, h->N, h->bound, h->factor[split],
                             h->floor0[split], h->floor1[split], out, h->counts, h->pick_threads);
        *picked += h->counts[0];
        if (h->ids)  /* rows of a subset: their token ids (-1, a token the pick left, stays) */
            for (int64_t t = 0; t < T; t++) out[t] = out[t] >= 0 ? h->ids[out[t]] : out[t];
        int stop = k + 1 == steps || h->counts[1] > 0;
        for (int64_t t = 0; t < T && !stop; t++) stop = is_stop(out[t], stop_ids, num_stop);
        for (int64_t t = 0; t < T && !stop; t++) {
            const int64_t p = positions[t] + 1;
            if (p / bs >= s->width) return k + 1;  /* the caller's tables do not reach: no slot to read */
            ids[t] = out[t];
            positions[t] = p;
            seq_lens[t] += 1;
            slots[t] = (int64_t)s->tables[t * s->width + p / bs] * bs + p % bs;
        }
        if (stop) return k + 1;
    }
    return steps;
}

int64_t flashllm_decode_burst(const stack_layer *layers, int64_t L, stack_step *s, const burst_head *h,
                              float *hidden, float *residual, float *scratch, int64_t steps,
                              const int64_t *stop_ids, int64_t num_stop, int64_t *tokens, int64_t *picked,
                              float *states) {
    float *const taps = s->taps;
    const int64_t done = burst_steps(layers, L, s, h, hidden, residual, scratch, steps, stop_ids, num_stop, tokens,
                                     picked, states, taps);
    s->taps = taps;
    return done;
}
