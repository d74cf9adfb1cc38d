"""Metal kernel sources for `mx.fast.metal_kernel`, as plain text.

Each `KernelSpec` holds exactly what is handed to `mx.fast.metal_kernel`: the
input and output names (MLX generates the kernel signature from them), the body
(`source`) and the `header`. The C++ test harness (tests/kernel_harness) wraps the
*same* text in the signature MLX would generate and runs it on the CPU, so the
strings below are the single definition of every kernel.

Rules the sources follow, so that they mean the same in Metal and in the harness:

* one thread per independent unit of work (a beam chunk, a batch row): no
  threadgroup memory, no barriers, no atomics, no SIMD-group functions;
* every Metal library call is qualified (`metal::min`); no `using namespace`;
* no pointers to inputs are taken (an input with fewer than 8 elements is in
  the `constant` address space, larger ones in `device`): inputs are indexed only;
* a thread writes only its own output slots, and writes every one of them;
* only IEEE add, subtract and compare on floats (no transcendental functions:
  the log-normalizer arrives as an input computed by MLX; see docs/kernels.md).

Comments inside `source` must not name Metal thread attributes other than the
ones used: MLX adds an attribute to the signature whenever its name appears in
the text.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class KernelSpec:
    """What `mx.fast.metal_kernel` receives (no template arguments are used)."""

    name: str
    input_names: tuple[str, ...]
    output_names: tuple[str, ...]
    source: str
    header: str = ""


# Candidate order of the expansion step: higher score first; on equal scores the
# lower flat index (parent * Vd + token) first. -inf ties with -inf, so candidates
# of dead beams are still ordered by flat index, as in `expand_beams`.
ORDER_HEADER = """
inline bool redrafter_before(float score, int flat, float other_score, int other_flat) {
  return score > other_score || (score == other_score && flat < other_flat);
}
"""

# Stage 1 of the expansion: one thread per (chunk c, beam w, row b).
# Grid (C, W, B). The thread scores the tokens [c * chunk, min((c + 1) * chunk, Vd))
# of beam w exactly as `expand_beams` does (score + (logit - lse), float32) and
# keeps the W best of them, in candidate order, in its own W output slots.
# Unused slots hold (-inf, W * Vd): after every real candidate in candidate order.
BEAM_CANDIDATES = KernelSpec(
    name="redrafter_beam_candidates",
    input_names=("scores", "logits", "lse", "params"),
    output_names=("candidate_scores", "candidate_flat"),
    header=ORDER_HEADER,
    source="""
  const int batch = logits_shape[0];
  const int width = logits_shape[1];
  const int vocab = logits_shape[2];
  const int chunk = params[0];
  const int num_chunks = (vocab + chunk - 1) / chunk;
  const int c = int(thread_position_in_grid.x);
  const int w = int(thread_position_in_grid.y);
  const int b = int(thread_position_in_grid.z);
  if (c >= num_chunks || w >= width || b >= batch) {
    return;
  }
  const int beam = b * width + w;
  const float base = scores[beam];
  const float norm = lse[beam];
  const int out = (beam * num_chunks + c) * width;
  const int past_end = width * vocab;
  for (int j = 0; j < width; ++j) {
    candidate_scores[out + j] = -INFINITY;
    candidate_flat[out + j] = past_end;
  }
  const int start = c * chunk;
  const int stop = metal::min(start + chunk, vocab);
  for (int t = start; t < stop; ++t) {
    const float logprob = logits[beam * vocab + t] - norm;
    const float value = base + logprob;
    const int flat = w * vocab + t;
    int j = width - 1;
    if (!redrafter_before(value, flat, candidate_scores[out + j], candidate_flat[out + j])) {
      continue;
    }
    while (j > 0 &&
           redrafter_before(value, flat, candidate_scores[out + j - 1],
                            candidate_flat[out + j - 1])) {
      candidate_scores[out + j] = candidate_scores[out + j - 1];
      candidate_flat[out + j] = candidate_flat[out + j - 1];
      --j;
    }
    candidate_scores[out + j] = value;
    candidate_flat[out + j] = flat;
  }
""",
)

# Stage 2 of the expansion: one thread per row b. Grid (B, 1, 1).
# Merges the row's W * C * W stage-1 candidates into the W best, best first, then
# splits each flat index into (parent, token). `params` = [W, Vd].
BEAM_SELECT = KernelSpec(
    name="redrafter_beam_select",
    input_names=("candidate_scores", "candidate_flat", "params"),
    output_names=("scores", "parents", "tokens"),
    header=ORDER_HEADER,
    source="""
  const int batch = candidate_scores_shape[0];
  const int count = candidate_scores_shape[1];
  const int width = params[0];
  const int vocab = params[1];
  const int b = int(thread_position_in_grid.x);
  if (b >= batch) {
    return;
  }
  const int row = b * width;
  for (int j = 0; j < width; ++j) {
    scores[row + j] = -INFINITY;
    parents[row + j] = width * vocab;
  }
  for (int i = 0; i < count; ++i) {
    const float value = candidate_scores[b * count + i];
    const int flat = candidate_flat[b * count + i];
    int j = width - 1;
    if (!redrafter_before(value, flat, scores[row + j], parents[row + j])) {
      continue;
    }
    while (j > 0 && redrafter_before(value, flat, scores[row + j - 1], parents[row + j - 1])) {
      scores[row + j] = scores[row + j - 1];
      parents[row + j] = parents[row + j - 1];
      --j;
    }
    scores[row + j] = value;
    parents[row + j] = flat;
  }
  for (int j = 0; j < width; ++j) {
    const int flat = parents[row + j];
    parents[row + j] = flat / vocab;
    tokens[row + j] = flat % vocab;
  }
""",
)

# Acceptance: one thread per row b. Grid (B, 1, 1).
# Walks every beam along the target's choices (the choice at a prefix's canonical
# node must equal the beam's next token, and that token's own node must have been
# verified), keeps the first beam with the longest run, and writes the step's
# outputs and every beam's run. Same contract as `accept.accept`.
ACCEPT = KernelSpec(
    name="redrafter_accept",
    input_names=("beams", "unpack", "canonical", "choices"),
    output_names=("num_accepted", "tokens", "path", "last_node", "bonus_tokens", "runs"),
    source="""
  const int batch = beams_shape[0];
  const int width = beams_shape[1];
  const int length = beams_shape[2];
  const int packed = choices_shape[1];
  const int b = int(thread_position_in_grid.x);
  if (b >= batch) {
    return;
  }
  const int row = b * width * length;
  const int choice_row = b * packed;
  int best = 0;
  int best_run = -1;
  for (int w = 0; w < width; ++w) {
    const int at = row + w * length;
    int run = 0;
    while (run + 1 < length) {
      const int node = metal::min(canonical[at + run], packed - 1);
      const bool verified = unpack[at + run + 1] < packed;
      if (!verified || choices[choice_row + node] != beams[at + run + 1]) {
        break;
      }
      ++run;
    }
    runs[b * width + w] = run;
    if (run > best_run) {
      best = w;
      best_run = run;
    }
  }
  const int at = row + best * length;
  const int accepted = best_run;
  const int bonus = choices[choice_row + metal::min(canonical[at + accepted], packed - 1)];
  for (int k = 0; k < length; ++k) {
    path[b * length + k] = unpack[at + k];
    int token = 0;
    if (k < accepted) {
      token = beams[at + k + 1];
    } else if (k == accepted) {
      token = bonus;
    }
    tokens[b * length + k] = token;
  }
  num_accepted[b] = accepted;
  last_node[b] = unpack[at + accepted];
  bonus_tokens[b] = bonus;
""",
)

# Tree packing: one thread per row b. Grid (B, 1, 1). `params` = [N, share_prefixes].
# Same contract as `tree.pack_tree`. The thread visits the row's W * L (beam, depth)
# positions in flat order (beam-major), so a prefix's first copy, and every node on
# a beam's path, is placed before any position that refers to it.
PACK_TREE = KernelSpec(
    name="redrafter_pack_tree",
    input_names=("beams", "params"),
    output_names=("tokens", "depths", "unpack", "canonical", "ancestors", "num_tokens"),
    source="""
  const int batch = beams_shape[0];
  const int width = beams_shape[1];
  const int length = beams_shape[2];
  const int packed = params[0];
  const bool share = params[1] != 0;
  const int b = int(thread_position_in_grid.x);
  if (b >= batch) {
    return;
  }
  const int row = b * width * length;
  const int out = b * packed;
  // 1. canonical[i, k] := the lowest beam j whose first k + 1 tokens equal beam i's.
  for (int f = 0; f < width * length; ++f) {
    canonical[row + f] = -1;
  }
  for (int i = 0; i < width; ++i) {
    for (int j = 0; j <= i; ++j) {
      for (int k = 0; k < length; ++k) {
        if (beams[row + j * length + k] != beams[row + i * length + k]) {
          break;
        }
        if (canonical[row + i * length + k] < 0) {
          canonical[row + i * length + k] = j;
        }
      }
    }
  }
  for (int p = 0; p < packed; ++p) {
    tokens[out + p] = 0;
    depths[out + p] = 0;
    for (int q = 0; q < packed; ++q) {
      ancestors[(out + p) * packed + q] = false;
    }
  }
  // 2. A position whose owner is its own beam is new: it takes the next packed index
  //    and, when it fits, is placed with the nodes of its path as its ancestors.
  //    Any other position points at its owner's node, placed earlier.
  //    A beam ends at its first ABSENT (negative) token: from there its positions
  //    are not packed and point at N.
  int count = 0;
  for (int i = 0; i < width; ++i) {
    bool ended = false;
    for (int k = 0; k < length; ++k) {
      const int f = i * length + k;
      ended = ended || beams[row + f] < 0;
      if (ended) {
        unpack[row + f] = packed;
        continue;
      }
      const int owner = share ? canonical[row + f] : i;
      if (owner != i) {
        unpack[row + f] = unpack[row + owner * length + k];
        continue;
      }
      const int p = count;
      ++count;
      unpack[row + f] = p;
      if (p >= packed) {
        continue;
      }
      tokens[out + p] = beams[row + f];
      depths[out + p] = k;
      for (int e = 0; e <= k; ++e) {
        const int q = unpack[row + i * length + e];
        if (q < packed) {
          ancestors[(out + p) * packed + q] = true;
        }
      }
    }
  }
  for (int p = count; p < packed; ++p) {
    ancestors[(out + p) * packed + p] = true;
  }
  // 3. canonical := the packed index of the prefix's first copy.
  for (int i = 0; i < width; ++i) {
    for (int k = 0; k < length; ++k) {
      const int f = i * length + k;
      canonical[row + f] = unpack[row + canonical[row + f] * length + k];
    }
  }
  num_tokens[b] = count;
""",
)

ALL_KERNELS = (BEAM_CANDIDATES, BEAM_SELECT, ACCEPT, PACK_TREE)
