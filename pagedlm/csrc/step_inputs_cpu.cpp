// A decode-only step's inputs (every scheduled request computes one token) from the worker's
// persistent batch, in one call: what worker/step_inputs.py's `decodes_only` branch computes
// with numpy, its reference (tests/test_input_batch.py checks the two equal). That branch
// is about twenty numpy calls, each a few microseconds after the model's forward has pushed
// the interpreter's and numpy's working set out of the caches: most of a decode step's input
// preparation on CPU.
//
// For the batch rows `rows` (scheduling order), with starts = num_computed[rows]:
//   order        rows sorted by start, longest first, ties in scheduling order (stable)
//   positions    starts in that order;  seq_lens = positions + 1
//   input_ids    token_ids[row, position]
//   block tables block_table[row, :max_blocks], max_blocks = max num_blocks[rows]
//   slot_mapping table[position / block_size] * block_size + position % block_size
//   every_row    whether every row's seq_len equals its num_tokens (each samples)
// written packed into one int64 array the caller keeps (see decode_step_inputs): the
// worker passes numpy arrays, read through the buffer protocol, so the call never enters
// torch's Python bindings.

#include "lite_bind.h"

#include <algorithm>
#include <cstdint>
#include <numeric>
#include <vector>

namespace {

const int64_t* long_data(const torch::Tensor& t, int64_t dims, const char* name) {
  TORCH_CHECK(t.scalar_type() == torch::kLong && t.dim() == dims && t.is_contiguous(), name,
              " must be a contiguous int64 tensor of ", dims, " dimension(s)");
  return t.data_ptr<int64_t>();
}

}  // namespace

// Writes [rows (n) | positions (n) | seq_lens (n) | input_ids (n) | slot_mapping (n) |
// cu (n + 1) | every_row | max_blocks | block tables (n * max_blocks, row-major)] to the
// start of `out`, n = rows.size(0) >= 1; returns how many elements that is. `out` must
// hold 6 n + 3 + n * block_table.size(1) elements (enough for any max_blocks).
int64_t decode_step_inputs(torch::Tensor rows, torch::Tensor num_computed,
                           torch::Tensor num_tokens, torch::Tensor token_ids,
                           torch::Tensor num_blocks, torch::Tensor block_table,
                           int64_t block_size, torch::Tensor out) {
  const int64_t* r = long_data(rows, 1, "rows");
  const int64_t* computed = long_data(num_computed, 1, "num_computed");
  const int64_t* lengths = long_data(num_tokens, 1, "num_tokens");
  const int64_t* tokens = long_data(token_ids, 2, "token_ids");
  const int64_t* blocks = long_data(num_blocks, 1, "num_blocks");
  const int64_t* table = long_data(block_table, 2, "block_table");
  const int64_t n = rows.size(0), num_rows = num_computed.size(0);
  const int64_t token_width = token_ids.size(1), table_width = block_table.size(1);
  TORCH_CHECK(n >= 1, "no rows");
  TORCH_CHECK(block_size >= 1, "block_size must be positive");
  TORCH_CHECK(num_tokens.size(0) == num_rows && token_ids.size(0) == num_rows &&
                  num_blocks.size(0) == num_rows && block_table.size(0) == num_rows,
              "the batch's columns differ in rows");
  int64_t max_blocks = 0;
  for (int64_t i = 0; i < n; ++i) {
    TORCH_CHECK(r[i] >= 0 && r[i] < num_rows, "row ", r[i], " outside the batch of ", num_rows);
    TORCH_CHECK(computed[r[i]] < token_width, "row ", r[i], ": position ", computed[r[i]],
                " outside its tokens");
    max_blocks = std::max(max_blocks, blocks[r[i]]);
  }
  TORCH_CHECK(max_blocks <= table_width, "num_blocks past the block table's width");
  std::vector<int64_t> order(n);
  std::iota(order.begin(), order.end(), 0);
  std::stable_sort(order.begin(), order.end(),
                   [&](int64_t a, int64_t b) { return computed[r[a]] > computed[r[b]]; });

  int64_t* o = const_cast<int64_t*>(long_data(out, 1, "out"));
  TORCH_CHECK(out.size(0) >= 6 * n + 3 + n * table_width, "out holds ", out.size(0),
              " elements, fewer than the ", 6 * n + 3 + n * table_width, " a step of ", n,
              " rows may need");
  int64_t *o_rows = o, *o_pos = o + n, *o_lens = o + 2 * n, *o_ids = o + 3 * n;
  int64_t *o_slots = o + 4 * n, *o_cu = o + 5 * n, *o_tables = o + 6 * n + 3;
  bool every_row = true;
  for (int64_t i = 0; i < n; ++i) {
    const int64_t row = r[order[i]];
    const int64_t pos = computed[row];
    const int64_t* row_table = table + row * table_width;
    const int64_t block = pos / block_size;
    TORCH_CHECK(block < max_blocks, "row ", row, ": position ", pos, " past its blocks");
    o_rows[i] = row;
    o_pos[i] = pos;
    o_lens[i] = pos + 1;
    o_ids[i] = tokens[row * token_width + pos];
    o_slots[i] = row_table[block] * block_size + pos % block_size;
    o_cu[i] = i;
    every_row = every_row && pos + 1 == lengths[row];
    std::copy(row_table, row_table + max_blocks, o_tables + i * max_blocks);
  }
  o_cu[n] = n;
  o[6 * n + 1] = every_row;
  o[6 * n + 2] = max_blocks;
  return 6 * n + 3 + n * max_blocks;
}

// The token deltas of a step's cached requests, applied to the persistent batch: what
// worker/input_batch.py's InputBatch.update does with numpy, its reference (the engine
// property test of tests/test_input_batch.py checks the batch after every step). For each
// request i, at batch row rows[i]: num_computed[row] = computed[i]; a one-token delta
// (a decode's last sample, or a beam's replaced last token) is written at
// token_ids[row, offsets[i]] and the row then ends after it (num_tokens[row] =
// offsets[i] + 1). Returns the requests whose delta is longer, which the caller applies;
// an empty delta (a prompt chunk) changes no token. token_ids must be wide enough for
// every one-token delta (the caller widens it first).
std::vector<int64_t> apply_token_deltas(torch::Tensor rows, std::vector<int64_t> computed,
                                        std::vector<std::vector<int64_t>> new_tokens,
                                        std::vector<int64_t> offsets, torch::Tensor num_computed,
                                        torch::Tensor num_tokens, torch::Tensor token_ids) {
  const int64_t* r = long_data(rows, 1, "rows");
  auto* done = const_cast<int64_t*>(long_data(num_computed, 1, "num_computed"));
  auto* lengths = const_cast<int64_t*>(long_data(num_tokens, 1, "num_tokens"));
  auto* tokens = const_cast<int64_t*>(long_data(token_ids, 2, "token_ids"));
  const int64_t n = rows.size(0), num_rows = num_computed.size(0), width = token_ids.size(1);
  TORCH_CHECK(static_cast<int64_t>(computed.size()) == n &&
                  static_cast<int64_t>(new_tokens.size()) == n &&
                  static_cast<int64_t>(offsets.size()) == n,
              "rows, computed, new_tokens and offsets differ in length");
  TORCH_CHECK(num_tokens.size(0) == num_rows && token_ids.size(0) == num_rows,
              "the batch's columns differ in rows");
  std::vector<int64_t> longer;
  for (int64_t i = 0; i < n; ++i) {
    const int64_t row = r[i];
    TORCH_CHECK(row >= 0 && row < num_rows, "row ", row, " outside the batch of ", num_rows);
    done[row] = computed[i];
    if (new_tokens[i].size() > 1) {
      longer.push_back(i);
    } else if (new_tokens[i].size() == 1) {
      TORCH_CHECK(offsets[i] >= 0 && offsets[i] < width, "row ", row, ": token offset ",
                  offsets[i], " outside its ", width, " token columns");
      tokens[row * width + offsets[i]] = new_tokens[i][0];
      lengths[row] = offsets[i] + 1;
    }
  }
  return longer;
}

// Its Python functions, bound into the decoder's module (llama_decode_cpu.cpp), which
// compiles this file with its own (csrc/build.py BUNDLED).
inline void bind_step_inputs_cpu(lite_bind::Module& m) {
  m.def<&decode_step_inputs>("decode_step_inputs",
                             "a decode-only step's inputs from the persistent batch (int64, CPU)");
  m.def<&apply_token_deltas>("apply_token_deltas",
                             "a step's one-token deltas applied to the persistent batch");
}
