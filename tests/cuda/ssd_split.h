// The SSD launchers' first-pass pieces per part, for the standalone harnesses (ssd_fwd_check.cu,
// ssd_bwd_check.cu): mirror of `local_records_per_part` in src/ops/ssd/plan.rs. `one_wave`
// (Pieces::OneWave: the forward's first pass on wgmma): the most of 1..4 whose blocks fit one wave;
// else (FewestTileTimes) the count of 1..4 that finishes in the fewest waves x (tiles of a piece + 4).
// The count in $env when set.
#pragma once
#include <stdint.h>
#include <stdlib.h>

#include <algorithm>
#include <climits>

static int64_t records_per_part(int64_t batch_heads, int64_t parts, int64_t tiles_per_part, const char* env,
                                bool one_wave = false) {
    if (parts <= 1) return 1;
    if (const char* v = getenv(env)) return std::min<int64_t>(std::max<int64_t>(1, atoll(v)), tiles_per_part);
    const int64_t blocks = batch_heads * (parts - 1), most = std::min<int64_t>(tiles_per_part, 4);
    if (one_wave) {
        for (int64_t r = most; r > 1; --r)
            if (blocks * r <= 264) return r;
        return 1;
    }
    int64_t best = 1, best_cost = INT64_MAX;
    for (int64_t r = 1; r <= most; ++r) {
        const int64_t cost = (blocks * r + 263) / 264 * ((tiles_per_part + r - 1) / r + 4);
        if (cost < best_cost) best = r, best_cost = cost;
    }
    return best;
}
