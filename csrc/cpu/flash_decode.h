// Short-query forward (decode): split-KV flash-decoding, written once for every tier.
//
// For q_len up to a few rows, the prefill blocking leaves most of a micro-tile empty and
// parallelises over (batch, heads) only. Here:
//   * the query rows of every head sharing a kv head are folded into one block of
//     M = (Hq / Hkv) * Lq rows, so each K / V row is read once per kv head (GQA);
//   * the kv sequence is cut into splits, one work item per (b, hkv, split):
//       DecodeSplit: online softmax over the split's keys -> partial (acc, m, l) per row
//       DecodeMerge: per (b, hkv), rows merged over the splits in order:
//         m* = max_s m_s;  l = sum_s 2^(m_s - m*) l_s;  out = sum_s 2^(m_s - m*) acc_s / l
//   * K and V rows are read in place (any row stride: a padded cache view is never copied; a
//     paged cache's rows through a table of row pointers filled a block at a time, TableRows,
//     so that the kernels cross its pages without leaving their loops),
//     bf16 / fp16 / float8_e4m3fn widened in registers by the trait's decode_qk / decode_pv
//     (float8 V, where the plan says so, in fp16: the fp16_pv trait of DecodeOpsOf).
//     K / V of storage type KV (q and out stay T): an e4m3 cache's scales (times the trait's
//     kE4m3UnitK / kE4m3UnitV, what its widening leaves out) go where the softmax scale goes
//     for K (the query rows, or the scores of traits that keep Q unscaled) and into the
//     partials for V, all linear, so the kernels never see them.
// Splits depend on the shape only, so results do not depend on the thread count.
#pragma once
#include <algorithm>
#include <cmath>
#include <cstring>

#include "flash_common.h"

namespace flashsdpa {
namespace cpu {
namespace FLASHSDPA_TIER_NS {

template <class TierOps, class T, class KV = T>
struct FlashDecode {
  using Ops = typename DecodeOpsOf<TierOps, KV>::type;
  using Fp16PvOps = typename DecodeOpsOf<TierOps, KV>::fp16_pv;  // where p.fp16_pv
  // Where Ops's float8 widening reads NaN bytes as numbers (kScan): items run_split refuses go
  // to ExactOps; the others' blocks are scanned after the kernels, and what NaN bytes give is
  // set then (patch_nan).
  using ExactOps = typename DecodeOpsOf<TierOps, KV>::exact;
  static constexpr bool kScan = !std::is_same<ExactOps, Ops>::value;
  static constexpr int kMaxBlock = 1024 / int(sizeof(KV));  // keys per block, at most
  static constexpr int64_t kMinSplit = 256;  // keys per split, at least
  static constexpr int64_t kMaxSplits = 32;
  // Splits per (b, kv head): enough for about kTargetItems items in all, no more (each split
  // restarts the K / V streams and adds a partial to merge). A shape-only choice, so results
  // never depend on the thread count.
  static constexpr int64_t kTargetItems = 64;

  static int64_t rows(const AttnParams& p) { return decode_rows(p); }

  // Caches laid out (.., L, Hkv, D) (flash-attn's, paged or not: the kv heads of a key side by
  // side) are read as whole key rows: one item takes every kv head of its keys, block by block
  // of keys and, within a block, a few keys at a time across its heads (sub_keys), rather than
  // one head's slice of every row per item. (.., Hkv, L, D) caches, with each head's keys
  // contiguous, are read one kv head per item.
  static constexpr int64_t kMaxItemHeads = 64;
  static bool all_heads(const AttnParams& p) {
    return p.Hkv > 1 && p.Hkv <= kMaxItemHeads && p.k_sh < p.k_sl && p.v_sh < p.v_sl;
  }
  static int64_t heads_per_item(const AttnParams& p) { return all_heads(p) ? p.Hkv : 1; }
  // Whether an item's P V runs per kv head over the whole block (sub_keys).
  static bool pv_per_head(const AttnParams& p) { return p.pv_whole && all_heads(p); }
  // Keys per block: the item's K rows (of every head it takes) in about decode_block_bytes()
  // (a share of the core's L2), so that K and V streams alternate as often per byte in every
  // width; a multiple of 16 keys. That share bounds what is prefetched a block ahead into L2
  // (and a gathered block); an all-heads item whose prefetches run near (a sub-block ahead)
  // holds no block in L2, and takes the keys of one head's share instead: each block costs an
  // online-softmax step for every head's rows (bench/ab.py --mode kvcache shows the gain), as
  // long as the block's scores (every head's rows: several a head with Lq > 1) fit that share.
  static int64_t block_keys(const AttnParams& p) {
    const bool whole_rows = !(Ops::kDecodeNearPf && p.near_pf) || gathers(p);
    const int64_t heads = whole_rows ? heads_per_item(p) : 1;
    const int64_t row = heads * max64(p.D, p.Dv) * int64_t(sizeof(KV));
    int64_t nb = decode_block_bytes() / row;
    if (!whole_rows)
      nb = min64(nb, decode_block_bytes() /
                         (heads_per_item(p) * rows(p) * int64_t(sizeof(float))));
    return min64(kMaxBlock, max64(16, nb / 16 * 16));
  }
  // Keys per sub-block: an all-heads item's Q.K passes (one per kv head) go over a block a
  // sub-block at a time, so that the item reads whole rows in order, a few at a time, each
  // sub-block's rows (of every head) in about decode_sub_bytes() (a share of the core's L1d,
  // isa.cpp); a multiple of the keys the trait's Q.K takes at a time (decode_key_group), at
  // least one group. Its P V passes too, unless pv_per_head: then each head's P V takes the whole
  // block, its V rows in L2 by then (prefetched a block ahead), so that P V's accumulators are
  // loaded and stored once a block. One head per item: the block.
  static int sub_keys(const AttnParams& p) {
    if (!all_heads(p)) return int(block_keys(p));
    const int64_t row = p.Hkv * max64(p.D, p.Dv) * int64_t(sizeof(KV));
    const int64_t g = Ops::template decode_key_group<KV>(rows(p));
    return int(min64(block_keys(p), max64(g, decode_sub_bytes() / row / g * g)));
  }
  // The splits cut the keys some row sees, [span_begin, span_end) (span_begin on the block
  // grid): a sliding window over a long cache spreads its few blocks over every split.
  static int64_t span_begin(const AttnParams& p) {
    return Visibility::of(p).rows_begin(0, p.Lq) / block_keys(p) * block_keys(p);
  }
  static int64_t span_end(const AttnParams& p) {
    return max64(span_begin(p), Visibility::of(p).rows_end(0, p.Lq));
  }
  static int64_t split_len(const AttnParams& p) {
    const int64_t span = span_end(p) - span_begin(p);
    const int64_t per_split = p.B * (p.Hkv / heads_per_item(p));  // items per split index
    const int64_t n = max64(1, min64(min64(kMaxSplits, ceil_div(kTargetItems, per_split)),
                                     ceil_div(span, kMinSplit)));
    return round_up(max64(1, ceil_div(span, n)), block_keys(p));
  }
  static int64_t n_splits(const AttnParams& p) {
    return max64(1, ceil_div(span_end(p) - span_begin(p), split_len(p)));
  }

  // Prefetches (the row sources' `every`, bytes apart in a row): K rows one per line; V rows
  // too, but in light decode (light_decode: little compute per byte) one per O::kLightVEvery
  // bytes (the decode trait's: how its P V walks a row, generic_ops.h), the hardware streamer
  // fetching the lines between as P V reads the rows in order. Not where an all-heads item's
  // P V walks one head's slice of the block's rows at a time (pv_per_head), rows apart: no
  // streamer follows that.
  template <class O>
  static int prefetch_every(const AttnParams& p, bool v) {
    return v && light_decode(p) && !pv_per_head(p) ? O::kLightVEvery : 64;
  }

  // Paged caches are read in place when pages hold a multiple of 16 keys; smaller or odd pages
  // are copied into the thread's scratch first, a block of keys at a time (gather_rows), where
  // the hardware's streams find them contiguous.
  static bool gathers(const AttnParams& p) { return p.page_size > 0 && p.page_size % 16 != 0; }

  // K or V as read in place: key j of kv head hk of batch b at row_at(p, side, b, hk, j).
  struct Side {
    const KV* base;
    int64_t sb, sh, sl, spage;
  };
  static Side k_side(const AttnParams& p) {
    return {static_cast<const KV*>(p.k), p.k_sb, p.k_sh, p.k_sl, p.k_spage};
  }
  static Side v_side(const AttnParams& p) {
    return {static_cast<const KV*>(p.v), p.v_sb, p.v_sh, p.v_sl, p.v_spage};
  }
  static const KV* row_at(const AttnParams& p, const Side& s, int64_t b, int64_t hk, int64_t j) {
    const KV* r = s.base + b * s.sb + hk * s.sh;
    if (p.page_size == 0) return r + j * s.sl;
    return r + int64_t(p.block_table[j / p.page_size]) * s.spage + j % p.page_size * s.sl;
  }
  // How far ahead (keys) the prefetches run. Near (with the non-temporal hint: split's `near`):
  // about a sub-block's bytes (decode_sub_bytes(), a share of L1d) of the stream the kernel
  // walks, K's or V's rows of one kv head. Otherwise (into L2): V the next block's same keys; K
  // at most kKAheadKeys, so that an item's first K block, which nothing prefetched, is covered
  // after its first keys (with long blocks, one kv head per item, that block is a large share
  // of an item).
  static constexpr int64_t kKAheadKeys = 64;
  static int64_t ahead(const AttnParams& p, const Side& s, bool v, bool near) {
    if (near) return max64(1, decode_sub_bytes() / max64(1, s.sl * int64_t(sizeof(KV))));
    return v ? block_keys(p) : min64(block_keys(p), kKAheadKeys);
  }

  // out[c] = the row of key j0 + c of kv head hk (c < n) of a paged cache, a page at a time
  // (one block table entry a page, none past key j0 + n - 1).
  static void fill_rows(const AttnParams& p, const Side& s, int64_t b, int64_t hk, int64_t j0,
                        int n, const KV** out) {
    const int64_t ps = p.page_size;
    for (int c = 0; c < n;) {
      const KV* r = row_at(p, s, b, hk, j0 + c);
      const int run = int(min64(n - c, ps - (j0 + c) % ps));
      for (int i = 0; i < run; ++i) out[c + i] = r + i * s.sl;
      c += run;
    }
  }
  // A block's keys [j0, j0 + nk) of kv head hk as the kernels read them: their rows, and the
  // rows `dist` keys on to prefetch meanwhile (none past the sequence's keys).
  static TableRows<KV> block_rows(const AttnParams& p, const Side& s, int64_t b, int64_t hk,
                                  int64_t j0, int nk, int64_t dist, int every, const KV** at,
                                  const KV** pf) {
    fill_rows(p, s, b, hk, j0, nk, at);
    const int n_pf = int(max64(0, min64(nk, p.Lk - j0 - dist)));
    fill_rows(p, s, b, hk, j0 + dist, n_pf, pf);
    for (int c = n_pf; c < nk; ++c) pf[c] = nullptr;
    return TableRows<KV>{at, pf, 0, every};
  }

  // One thread's buffers over its scratch (null: sizes only, in total); q, s, acc, m, l for
  // the rows of every head of an item.
  struct Layout {
    int ldq, lds, ldacc;
    float *q, *s, *acc, *m, *l, *shift, *mask;
    const KV **k_at, **k_pf, **v_at, **v_pf;  // a block's row tables (block_rows)
    KV* kv;  // gathered: one block of K or V rows, head after head
    int64_t total;
    Layout(const AttnParams& p, float* scratch = nullptr) {
      const int64_t M = rows(p) * heads_per_item(p), nb = block_keys(p);
      ldq = int(p.D);
      lds = int(round_up(nb, 16));
      ldacc = int(round_up(p.Dv, 16));
      Carve c{scratch};
      q = c.take(M * p.D);
      s = c.take(M * lds);
      acc = c.take(M * ldacc);
      m = c.take(M);
      l = c.take(M);
      shift = c.take(M);
      mask = c.take(M * lds);
      const auto table = [&] {  // nb row pointers (TableRows: paged caches read in place)
        const int64_t n = p.page_size > 0 && !gathers(p) ? nb : 0;
        return reinterpret_cast<const KV**>(c.take(n * int64_t(sizeof(KV*) / sizeof(float))));
      };
      k_at = table(), k_pf = table(), v_at = table(), v_pf = table();
      kv = reinterpret_cast<KV*>(c.take(
          gathers(p) ? ceil_div(nb * max64(span(p, p.k_sh, p.D), span(p, p.v_sh, p.Dv)) *
                                    int64_t(sizeof(KV)), 4)
                     : 0));
      total = c.total;
    }
  };
  static int64_t scratch_floats(const AttnParams& p) { return Layout(p).total; }

  // Partial results, [B * Hkv * n_splits][M][ldacc + 3]: acc, then m, l and the mask shift
  // (each split's rows relative to the shift of the keys they see in it; the merge's order,
  // whichever item wrote them).
  static int64_t part_floats(const AttnParams& p) {
    return p.B * p.Hkv * n_splits(p) * rows(p) * (Layout(p).ldacc + 3);
  }
  static int64_t split_items(const AttnParams& p) {
    return p.B * (p.Hkv / heads_per_item(p)) * n_splits(p);
  }
  static int64_t merge_items(const AttnParams& p) { return p.B * p.Hkv; }

  // Small pages (gathers): keys j0 .. j0 + n - 1 of kv heads [hk0, hk0 + nh) copied into dst, key after
  // key, each key's span of the item's heads (head e at e * sh, `span` elements a key) as it
  // lies in the page, where the decode kernels then read them as from a contiguous cache. The
  // keys of one page are one copy when the page's rows are contiguous. The blocks lie anywhere,
  // so no hardware stream runs ahead across them: each key is prefetched kGatherAhead keys
  // before its copy (within the sequence's keys: the block table is read no further).
  static constexpr int64_t kGatherAhead = 32;
  static int64_t span(const AttnParams& p, int64_t sh, int64_t width) {
    return (heads_per_item(p) - 1) * sh + width;
  }
  static void gather_rows(const AttnParams& p, const Side& s, int64_t b, int64_t hk0, int64_t j0,
                          int n, int64_t width, KV* dst) {
    const auto row = [&](int64_t j) { return row_at(p, s, b, hk0, j); };
    const int64_t w = span(p, s.sh, width), bytes = w * int64_t(sizeof(KV));
    for (int c = 0; c < n;) {
      const int64_t j = j0 + c;
      const int run = s.sl == w ? int(min64(n - c, p.page_size - j % p.page_size)) : 1;
      for (int64_t a = j + kGatherAhead; a < min64(j + kGatherAhead + run, p.Lk); ++a) {
        const char* r = reinterpret_cast<const char*>(row(a));
        for (int64_t off = 0; off < bytes; off += 64) __builtin_prefetch(r + off, 0, 2);
      }
      std::memcpy(dst + int64_t(c) * w, row(j), size_t(bytes * run));
      c += run;
    }
  }

  // The factor an e4m3 cache's K (v: V) values of kv head hk need as trait O widens them: its
  // scale times O's unit; 1 for the other types.
  template <class O>
  static float kv_factor(const float* scale, int64_t sh, int64_t hk, bool v) {
    if constexpr (std::is_same<KV, e4m3_t>::value)
      return scale[hk * sh] * (v ? O::kE4m3UnitV : O::kE4m3UnitK);
    (void)scale, (void)sh, (void)hk, (void)v;
    return 1.0f;
  }

  static void run_split(const AttnParams& p, int64_t item, float* scratch) {
    if constexpr (!std::is_same<Fp16PvOps, Ops>::value)
      if (p.fp16_pv) return split<Fp16PvOps>(p, item, scratch);
    // kScan: Ops where the plan takes it (p.e4m3_fast) and this thread keeps denormals
    // (Ops::denormals_kept: its widening makes e4m3's subnormals denormals); fast_item decides
    // the rest once the item's q rows are loaded
    if constexpr (kScan)
      if (!p.e4m3_fast || !Ops::denormals_kept()) return exact_item(p, item, scratch);
    split<Ops>(p, item, scratch);
  }
  static void exact_item(const AttnParams& p, int64_t item, float* scratch) {
    count_path(p, &PathCounters::decode_e4m3_exact_items, 1);
    split<ExactOps>(p, item, scratch);
  }

  // kScan: whether Ops may take an item whose query rows, scaled for it, are q[0, n): no |q|
  // above 2^126 (its K unit puts 2^120 there).
  static bool fast_item(const float* q, int64_t n) {
    float m = 0.0f;
    for (int64_t i = 0; i < n; ++i) m = std::max(m, std::fabs(q[i]));
    return m <= 0x1p126f;  // (inf: false; NaN, skipped by max, gives NaN either way)
  }

  // kScan: whether keys [0, n) of rows r (every head of the item: `bytes` from each row's
  // start) hold a NaN byte (0x7F, 0xFF; Ops::nan_bytes), after the kernels read them (in
  // cache). Rows that follow one another in memory are scanned as one run.
  template <class R>
  static bool nan_bytes(const R& r, int n, int64_t bytes) {
    bool any = false;
    auto c = r.cursor();
    const uint8_t* run = nullptr;
    int64_t len = 0;
    for (int u = 0; u < n; ++u, c.next()) {
      const uint8_t* b = reinterpret_cast<const uint8_t*>(c.row());
      if (b != run + len) {
        any |= len > 0 && Ops::nan_bytes(run, len);
        run = b, len = 0;
      }
      len += bytes;
    }
    return any || (len > 0 && Ops::nan_bytes(run, len));
  }
  // kScan, after Ops's kernels over keys [0, n) of a sub-block's rows (head e at e * sh, width
  // elements each): where they hold a NaN byte (nan_bytes, counted), what the exact widening
  // gives in the M rows of each head e with heads[e] (null: every head) of out (head e at
  // e * ld_head, rows ld apart): K (v false), that key's score NaN; V, NaN in that dim.
  template <class R>
  static void patch_nan(const AttnParams& p, const R& rows, int n, int nh, int64_t sh,
                        int64_t width, bool v, const bool* heads, float* out, int64_t ld_head,
                        int ld, int64_t M) {
    if (!nan_bytes(rows, n, span(p, sh, width))) return;
    count_path(p, &PathCounters::decode_e4m3_nan_patched, 1);
    for (int e = 0; e < nh; ++e) {
      if (heads && !heads[e]) continue;
      auto c = rows.shift(e * sh).cursor();
      for (int u = 0; u < n; ++u, c.next()) {
        const uint8_t* b = reinterpret_cast<const uint8_t*>(c.row());
        for (int64_t d = 0; d < width; ++d)
          if ((b[d] & 0x7F) == 0x7F)
            for (int64_t r = 0; r < M; ++r) out[e * ld_head + r * ld + (v ? d : u)] = kNaN;
      }
    }
  }

  // Row r of the folded block of kv head hk: query head h = hk * group + r / Lq, query row
  // i = r % Lq. An item covers kv heads [hk0, hk0 + nh), their rows one block after another.
  template <class O>
  static void split(const AttnParams& p, int64_t item, float* scratch) {
    StepClock clock(p);  // (the steps' time, when counting: PathCounters::decode_*_ns)
    const Layout L(p, scratch);
    const int64_t ns = n_splits(p), M = rows(p), group = p.Hq / p.Hkv, nb = block_keys(p);
    const int nh = int(heads_per_item(p));
    const int64_t bhk = item / ns, sp = item % ns;
    const int64_t b = bhk / (p.Hkv / nh), hk0 = bhk % (p.Hkv / nh) * nh;
    const int64_t j_begin = span_begin(p) + sp * split_len(p);
    const int64_t j_end = min64(span_end(p), j_begin + split_len(p));
    const bool gather = gathers(p);
    // near prefetches (the plan's near_pf, where the trait has them): their distance, their
    // hint (row sources of their own: kernels instantiated for it) and their count, all from this
    const bool near = O::kDecodeNearPf && p.near_pf;
    const Side ks = k_side(p), vs = v_side(p);
    // Per head of the item, the scores' scale (log2 units) times its K factor: folded into Q,
    // or applied to the scores by traits that keep Q unscaled.
    float q_mul[kMaxItemHeads], s_mul[kMaxItemHeads];
    for (int e = 0; e < nh; ++e) {
      const float mul = p.scale * kLog2e * kv_factor<O>(p.k_scale, p.k_scale_sh, hk0 + e, false);
      q_mul[e] = caps<O>().scale_in_a ? mul : 1.0f;
      s_mul[e] = caps<O>().scale_in_a ? 1.0f : mul;
    }
    const Visibility vis = Visibility::of(p);
    for (int64_t r = 0; r < nh * M; ++r) {
      const int64_t hk = hk0 + r / M, h = hk * group + r % M / p.Lq, i = r % M % p.Lq;
      L.shift[r] = mask_shift(p, b, h, i, max64(j_begin, vis.begin(i)), min64(j_end, vis.end(i)));
      O::Row::load_rows(q_row<T>(p, b, h, i), 0, 1, int(p.D), L.q + r * L.ldq, L.ldq,
                        q_mul[r / M]);
      O::template decode_to_order<KV>(L.q + r * L.ldq, int(p.D));
      L.m[r] = kNegInf;  // (a sink joins in run_merge, once per row)
      L.l[r] = 0.0f;
      for (int d = 0; d < L.ldacc; ++d) L.acc[r * L.ldacc + d] = 0.0f;
    }
    constexpr bool scan = kScan && std::is_same<O, Ops>::value;
    clock.lap(&PathCounters::decode_softmax_ns);
    if constexpr (scan)
      if (!fast_item(L.q, nh * M * L.ldq)) return exact_item(p, item, scratch);
    bool any[kMaxItemHeads];  // per head of the item
    const int sub = sub_keys(p);
    for (int64_t j0 = j_begin; j0 < j_end; j0 += nb) {
      const int nk = int(min64(nb, j_end - j0));
      count_path(p, &PathCounters::decode_blocks, 1);
      if constexpr (scan) count_path(p, &PathCounters::decode_e4m3_fast_blocks, 1);
      if (std::is_same<O, Fp16PvOps>::value && !std::is_same<O, Ops>::value)
        count_path(p, &PathCounters::decode_fp16_pv_blocks, 1);
      // The block's rows of kv head hk0 (head hk0 + e: shifted by e * sh) to f, in the form
      // the cache takes: equally spaced (contiguous; gathered pages) or a table (paged).
      const auto with_rows = [&](const Side& side, int64_t width, bool v, const KV** at,
                                 const KV** pf, auto&& f) {
        const int64_t dist = ahead(p, side, v, near);
        const int every = prefetch_every<O>(p, v);
        if (gather) {
          gather_rows(p, side, b, hk0, j0, nk, width, L.kv);
          return f(StridedRows<KV>{L.kv, span(p, side.sh, width), 0, every});
        }
        if (p.page_size == 0) {  // (no prefetches from a block whose first target is past the keys)
          const KV* r0 = row_at(p, side, b, hk0, j0);
          const int64_t to = j0 + dist < p.Lk ? dist * side.sl : 0;
          if constexpr (O::kDecodeNearPf)
            if (near) return f(StridedRows<KV, true>{r0, side.sl, to, every});
          return f(StridedRows<KV>{r0, side.sl, to, every});
        }
        const TableRows<KV> rows = block_rows(p, side, b, hk0, j0, nk, dist, every, at, pf);
        if constexpr (O::kDecodeNearPf)
          if (near) return f(TableRows<KV, true>{rows.at, rows.pf, rows.off, rows.every});
        return f(rows);
      };
      if (gather) count_path(p, &PathCounters::decode_gathered_blocks, 1);
      else if (near) count_path(p, &PathCounters::decode_near_pf_blocks, 1);
      bool any_head = false;
      if (sub < nk) count_path(p, &PathCounters::decode_sub_blocks, ceil_div(nk, sub));
      with_rows(ks, p.D, false, L.k_at, L.k_pf, [&](const auto& kr) {
        for (int j = 0; j < nk; j += sub) {
          const int n = sub < nk - j ? sub : nk - j;
          for (int e = 0; e < nh; ++e)
            O::decode_qk(kr.from(j).shift(e * p.k_sh), n, int(p.D), L.q + e * M * L.ldq, L.ldq,
                         int(M), L.s + e * M * L.lds + j, L.lds);
          if constexpr (scan)
            patch_nan(p, kr.from(j), n, nh, p.k_sh, p.D, false, nullptr, L.s + j, M * L.lds,
                      L.lds, M);
        }
        clock.lap(&PathCounters::decode_qk_ns);
        for (int e = 0; e < nh; ++e) {
          const int64_t hk = hk0 + e;
          float* s = L.s + e * M * L.lds;
          any[e] = false;
          for (int64_t r = 0; r < M; ++r) {
            const int64_t h = hk * group + r / p.Lq, i = r % p.Lq, er = e * M + r;
            float* madd = nullptr;
            if (p.mask_type != MaskType::None) {
              madd = L.mask + er * L.lds;
              mask_row_log2(p, b, h, i, j0, nk, madd, L.shift[er]);
            }
            RowScore rs = row_score(p, b, h, i, j0, s_mul[e], madd);
            rs.lo = vis.row_first(i, j0, nk), rs.hi = vis.row_cols(i, j0, nk);
            any[e] |= online_softmax_row<O>(s + r * L.lds, nk, rs, &L.m[er], &L.l[er],
                                            L.acc + er * L.ldacc, int(p.Dv));
          }
          any_head |= any[e];
        }
        clock.lap(&PathCounters::decode_softmax_ns);
      });
      if (!any_head) continue;
      const int pv_sub = pv_per_head(p) ? nk : sub;
      if (pv_sub > sub) count_path(p, &PathCounters::decode_pv_whole_blocks, 1);
      with_rows(vs, p.Dv, true, L.v_at, L.v_pf, [&](const auto& vr) {
        for (int j = 0; j < nk; j += pv_sub) {
          const int n = pv_sub < nk - j ? pv_sub : nk - j;
          for (int e = 0; e < nh; ++e)
            if (any[e])
              O::decode_pv(vr.from(j).shift(e * p.v_sh), n, int(p.Dv), L.s + e * M * L.lds + j,
                           L.lds, int(M), L.acc + e * M * L.ldacc, L.ldacc);
          if constexpr (scan)
            patch_nan(p, vr.from(j), n, nh, p.v_sh, p.Dv, true, any, L.acc, M * L.ldacc,
                      L.ldacc, M);
        }
        clock.lap(&PathCounters::decode_pv_ns);
      });
    }
    const int64_t ld_part = L.ldacc + 3;
    for (int e = 0; e < nh; ++e) {  // partial (b, hk, sp), as the merge reads them
      float* part = p.dec_part + ((b * p.Hkv + hk0 + e) * ns + sp) * M * ld_part;
      const float v_mul = kv_factor<O>(p.v_scale, p.v_scale_sh, hk0 + e, true);
      for (int64_t r = 0; r < M; ++r) {
        const int64_t er = e * M + r;
        float* pr = part + r * ld_part;
        O::template decode_to_natural<KV>(L.acc + er * L.ldacc, int(p.Dv));
        for (int d = 0; d < int(p.Dv); ++d) pr[d] = L.acc[er * L.ldacc + d] * v_mul;
        pr[L.ldacc] = L.m[er];
        pr[L.ldacc + 1] = L.l[er];
        pr[L.ldacc + 2] = L.shift[er];
      }
    }
    clock.lap(&PathCounters::decode_softmax_ns);
  }

  static void run_merge(const AttnParams& p, int64_t item, float* scratch) {
    const Layout L(p, scratch);
    const int64_t ns = n_splits(p), M = rows(p), group = p.Hq / p.Hkv;
    const int64_t b = item / p.Hkv, hk = item % p.Hkv;
    const int64_t ld_part = L.ldacc + 3;
    const float* parts = p.dec_part + item * ns * M * ld_part;
    float* acc = L.acc;
    for (int64_t r = 0; r < M; ++r) {
      const int64_t h = hk * group + r / p.Lq;
      // the row's shift: the largest of its splits' (those that saw a key), each split's m moved
      // to it (exact where it matters: a split far below weighs 0)
      const auto part = [&](int64_t sp) { return parts + (sp * M + r) * ld_part; };
      const auto seen = [&](int64_t sp) { return part(sp)[L.ldacc + 1] != 0.0f; };
      float shift = kNegInf;
      for (int64_t sp = 0; sp < ns; ++sp)
        if (seen(sp) && part(sp)[L.ldacc + 2] > shift) shift = part(sp)[L.ldacc + 2];
      if (shift == kNegInf) shift = 0.0f;
      const auto m_of = [&](int64_t sp) {
        return part(sp)[L.ldacc] + (part(sp)[L.ldacc + 2] - shift) * kLog2e;
      };
      float m_sink, l_all;
      start_row(p, h, &m_sink, &l_all, shift);  // the sink, if any: in the merged state once
      float m_all = m_sink;
      for (int64_t sp = 0; sp < ns; ++sp)
        if (seen(sp)) {
          const float ms = m_of(sp);
          m_all = ms > m_all ? ms : m_all;
        }
      if (p.sinks) l_all = exp2_poly(m_sink - m_all);
      float* ar = acc + r * L.ldacc;
      for (int d = 0; d < int(p.Dv); ++d) ar[d] = 0.0f;
      if (m_all != kNegInf) {
        for (int64_t sp = 0; sp < ns; ++sp) {
          if (!seen(sp)) continue;  // nothing visible in this split
          const float* pr = part(sp);
          const float w = exp2_poly(m_of(sp) - m_all);
          l_all += w * pr[L.ldacc + 1];
          for (int d = 0; d < int(p.Dv); ++d) ar[d] += w * pr[d];
        }
      }
      finish_row<Ops, T>(p, b, h, r % p.Lq, m_all, l_all, ar, shift);
    }
  }
};

}  // namespace FLASHSDPA_TIER_NS
}  // namespace cpu
}  // namespace flashsdpa
