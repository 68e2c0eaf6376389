// Paged decode attention (paged_attention_cpu.cpp), for the decoder, whose library compiles
// that file beside its own (csrc/__init__.py LIBRARY_SOURCES: two translation units that
// build in parallel).
#pragma once
#include "lite_bind.h"

#include <vector>

// query [num_seqs, num_heads, head_dim] float32 contiguous, already multiplied by the
// softmax scale; caches [num_blocks, block_size, num_kv_heads, head_dim] contiguous;
// block_tables [num_seqs, max_blocks] int64; seq_lens on the host; out float32 contiguous
// [num_seqs, num_heads, head_dim] (a preallocated buffer).
void paged_decode_into(const torch::Tensor& query, const torch::Tensor& k_cache,
                       const torch::Tensor& v_cache, const torch::Tensor& block_tables,
                       const std::vector<int64_t>& seq_lens, double soft_cap, int64_t window,
                       const c10::optional<torch::Tensor>& slopes, torch::Tensor& out);

// Binds paged_decode into the decoder's module.
void bind_paged_attention_cpu(lite_bind::Module& m);
