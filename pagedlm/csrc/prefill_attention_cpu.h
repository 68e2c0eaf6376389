// Paged prefill attention (prefill_attention_cpu.cpp), for the decoder, whose library
// compiles that file beside its own (csrc/__init__.py LIBRARY_SOURCES).
#pragma once
#include "lite_bind.h"

#include <vector>

// q [num_tokens, num_heads, head_dim] float32 contiguous (the prefill rows of the step,
// sequence after sequence, not scaled); caches [num_blocks, block_size, num_kv_heads,
// head_dim] contiguous, the step's new tokens already written; block_tables [num_seqs,
// max_blocks] int64; query_start [num_seqs + 1] offsets into q's rows; seq_lens [num_seqs]
// each sequence's context length including its new tokens; window <= 0 for none; out
// float32 contiguous shaped as q (a preallocated buffer).
void paged_prefill_into(const torch::Tensor& q, const torch::Tensor& k_cache,
                        const torch::Tensor& v_cache, const torch::Tensor& block_tables,
                        const std::vector<int64_t>& query_start, const std::vector<int64_t>& seq_lens,
                        double scale, int64_t window, torch::Tensor& out);

// Binds paged_prefill (and the vector width `lanes` head_dim must be a multiple of) into
// the decoder's module.
void bind_prefill_attention_cpu(lite_bind::Module& m);
