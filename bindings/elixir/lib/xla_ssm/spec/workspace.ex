defmodule XlaSsm.Spec.Workspace do
  @moduledoc """
  Workspace sizes and the SSD `chunk_states` dtype, ported from the Rust library.

  The library exports these as C functions (`xla_ssm_selective_scan_fwd_workspace_bytes`,
  `xla_ssm_selective_scan_bwd_workspace_bytes`, `xla_ssm_ssd_fwd_workspace_bytes`,
  `xla_ssm_ssd_bwd_workspace_bytes`, `xla_ssm_ssd_chunk_states_dtype`). Elixir cannot call them
  without a NIF, so their formulas are mirrored here: they depend on shapes only. The sources are
  `src/capi/selective_scan.rs` and `src/capi/ssd.rs` (argument checks), `src/ops/selective_scan/mod.rs` (`split_plan`,
  `workspace_bytes`, `bwd_layout`) and `src/ops/ssd/plan.rs` (`fwd_layout`, `bwd_layout`,
  `mma_*`). `tests/suite/exla_frames.rs` checks every size in `test/fixtures/exla_calls.txt` against
  the library, so a change on either side shows up there.

  All arithmetic is on non-negative integers, where Rust's `/` is `div/2`.
  """

  # selective_scan/mod.rs
  @tile_channels 64
  @tiled_max_dstate 256
  @split_sms 132
  @fwd_split_target_blocks 4 * @split_sms
  @split_min_chunk 64
  @checkpoint_multiple 32
  @bwd_threads 128
  @bwd_blocks_per_sm 2

  # ssd/plan.rs
  @align 256
  @mma_tile 64
  @mma_headdim 64
  @mma_min_headdim 32
  @mma_dstates [64, 128]
  @mma_max_dstate 256
  @mma_wave_blocks 264
  @mma_max_chunk 256
  @msum_max_split 2
  @max_local_records 4
  @local_block_tiles 4

  @typedoc "An element type, Nx style."
  @type type :: {:f, 32} | {:bf, 16} | {:f, 16}

  ## selective scan

  @doc """
  `xla_ssm_selective_scan_fwd_workspace_bytes(batch, dim, seqlen, dstate)`: bytes that let the
  CUDA forward split long sequences (0 where it never splits). Negative sizes count as 0.
  """
  @spec selective_scan_fwd_bytes(integer, integer, integer, integer) :: non_neg_integer
  def selective_scan_fwd_bytes(batch, dim, seqlen, dstate) do
    [batch, dim, seqlen, dstate] = Enum.map([batch, dim, seqlen, dstate], &max(&1, 0))
    scan_fwd_bytes(batch, dim, seqlen, dstate)
  end

  # ops::selective_scan::workspace_bytes (no clamping: callers pass non-negative sizes).
  defp scan_fwd_bytes(batch, dim, seqlen, dstate) do
    {_chunk_len, n_chunks} = split_plan(batch, dim, seqlen)

    if n_chunks <= 1 or dstate > @tiled_max_dstate do
      0
    else
      (n_chunks - 1) * batch * dim * split_record_floats(dstate) * 4
    end
  end

  defp split_plan(batch, dim, seqlen) do
    tiles = batch * ceil_div(dim, @tile_channels)

    if tiles == 0 or 2 * tiles >= @fwd_split_target_blocks or seqlen < 2 * @split_min_chunk do
      {seqlen, 1}
    else
      chunks = min(div(@fwd_split_target_blocks, tiles), div(seqlen, @split_min_chunk))
      # A whole number of 32-step tiles.
      chunk_len = div(ceil_div(seqlen, chunks) + 31, 32) * 32
      {chunk_len, ceil_div(seqlen, chunk_len)}
    end
  end

  # One (chunk, batch, channel) record: the tiled kernel's states plus the sum of dt.
  defp split_record_floats(dstate) do
    tpc = tiled_threads_per_channel(dstate)
    thread_states = if tpc == 1, do: 16, else: 8
    thread_states * tpc + 1
  end

  defp tiled_threads_per_channel(dstate) do
    threads = div(max(dstate, 1) + 7, 8)
    next_power_of_two(max(threads, 2))
  end

  @doc """
  `xla_ssm_selective_scan_bwd_workspace_bytes(batch, dim, seqlen, dstate, groups)` (`groups` = 0
  for time-invariant B/C): what the CUDA backward needs. 0 when `groups` does not divide `dim`.
  """
  @spec selective_scan_bwd_bytes(integer, integer, integer, integer, integer) :: non_neg_integer
  def selective_scan_bwd_bytes(batch, dim, seqlen, dstate, groups) do
    [batch, dim, seqlen, dstate, groups] =
      Enum.map([batch, dim, seqlen, dstate, groups], &max(&1, 0))

    if groups > 0 and rem(dim, groups) != 0 do
      0
    else
      scan_bwd_bytes(batch, dim, seqlen, dstate, groups)
    end
  end

  # ops::selective_scan::bwd_workspace_bytes: 4 * bwd_layout(.., checkpoint_len = 0).floats.
  defp scan_bwd_bytes(batch, dim, seqlen, dstate, groups) do
    tpc = next_power_of_two(max(div(dstate + 7, 8), 2))
    channels = div(@bwd_threads, tpc)
    {n_groups, group_dim} = if groups > 0, do: {groups, div(dim, groups)}, else: {1, dim}
    tiles_per_group = ceil_div(group_dim, channels)
    blocks = n_groups * tiles_per_group * batch
    target = @bwd_blocks_per_sm * @split_sms
    # Sized for the most parts any checkpoint_len could give: that of the shortest (32).
    chunks = ceil_div(seqlen, @checkpoint_multiple)

    n_split =
      if blocks == 0 or 2 * blocks >= target or chunks < 2 do
        1
      else
        want = min(div(target, blocks), chunks)
        per_part = ceil_div(chunks, want)
        ceil_div(chunks, per_part)
      end

    rows = batch * dim

    bc_part_floats =
      if groups > 0,
        do: batch * groups * tiles_per_group * seqlen * dstate,
        else: n_split * rows * dstate

    floats =
      2 * bc_part_floats + n_split * (rows * dstate + 2 * rows) +
        (n_split - 1) * rows * (dstate + 1)

    4 * floats
  end

  ## SSD

  @doc """
  `xla_ssm_ssd_chunk_states_dtype(headdim, dstate, chunk_size, dtype)`: the element type of
  `chunk_states`, the inputs' type where the tensor-core kernels run, else `{:f, 32}`.
  """
  @spec ssd_chunk_states_type(integer, integer, integer, type) :: type
  def ssd_chunk_states_type(headdim, dstate, chunk_size, type) do
    shape = %{headdim: headdim, dstate: dstate, chunk_size: chunk_size, elem_bytes: elem_bytes(type)}
    if mma_applies?(shape), do: type, else: {:f, 32}
  end

  @doc """
  `xla_ssm_ssd_fwd_workspace_bytes(batch, seqlen, heads, headdim, dstate, groups, chunk_size,
  dtype)`. 0 for a shape the call would refuse (a negative size, groups 0 or not dividing heads).
  """
  @spec ssd_fwd_bytes(integer, integer, integer, integer, integer, integer, integer, type) ::
          non_neg_integer
  def ssd_fwd_bytes(batch, seqlen, heads, headdim, dstate, groups, chunk_size, type) do
    case ssd_shape(batch, seqlen, heads, headdim, dstate, groups, chunk_size, type) do
      nil -> 0
      s -> if mma_applies?(s), do: mma_workspace_bytes(s, false), else: generic_fwd_bytes(s)
    end
  end

  @doc """
  `xla_ssm_ssd_bwd_workspace_bytes(...)`, same arguments as `ssd_fwd_bytes/8`.
  """
  @spec ssd_bwd_bytes(integer, integer, integer, integer, integer, integer, integer, type) ::
          non_neg_integer
  def ssd_bwd_bytes(batch, seqlen, heads, headdim, dstate, groups, chunk_size, type) do
    case ssd_shape(batch, seqlen, heads, headdim, dstate, groups, chunk_size, type) do
      nil -> 0
      s -> if mma_applies?(s), do: mma_workspace_bytes(s, true), else: generic_bwd_bytes(s)
    end
  end

  # plan::sane: the C API answers 0 for these (the call itself would be refused).
  defp ssd_shape(batch, seqlen, heads, headdim, dstate, groups, chunk_size, type) do
    sizes = [batch, seqlen, heads, headdim, dstate, groups, chunk_size]

    if Enum.any?(sizes, &(&1 < 0)) or groups == 0 or rem(heads, groups) != 0 do
      nil
    else
      %{
        batch: batch,
        seqlen: seqlen,
        heads: heads,
        headdim: headdim,
        dstate: dstate,
        groups: groups,
        chunk_size: chunk_size,
        elem_bytes: elem_bytes(type)
      }
    end
  end

  defp elem_bytes({:f, 32}), do: 4
  defp elem_bytes({:bf, 16}), do: 2
  defp elem_bytes({:f, 16}), do: 2

  defp elem_bytes(other),
    do: raise(ArgumentError, "expected an f32, bf16 or f16 type, got #{inspect(other)}")

  defp mma_applies?(s) do
    s.elem_bytes == 2 and mma_headdim(s.headdim) != nil and
      mma_dstate(s.dstate) != nil and rem(s.chunk_size, @mma_tile) == 0 and
      s.chunk_size <= @mma_max_chunk
  end

  # plan::mma_headdim: the next multiple of 64 from 32 channels.
  defp mma_headdim(p) when p >= @mma_min_headdim, do: ceil_div(p, @mma_headdim) * @mma_headdim
  defp mma_headdim(_p), do: nil

  # plan::mma_dstate: the smallest of the kernels' dstates that holds it, else two of the largest.
  defp mma_dstate(n), do: Enum.find(@mma_dstates ++ [@mma_max_dstate], &(n >= 1 and n <= &1))

  # plan::state_halves: a widened state past the largest instance runs as two halves of it.
  defp state_halves(n) do
    case mma_dstate(n) do
      nil -> 1
      width -> max(div(width, List.last(@mma_dstates)), 1)
    end
  end

  # plan::mma_shape: the state widened, two halves as twice the groups and heads, heads widened to
  # a multiple of 64, each head as headdim / 64 heads of 64.
  defp mma_shape(s) do
    headdim = mma_headdim(s.headdim) || s.headdim
    ways = max(div(headdim, @mma_headdim), 1)
    stage = state_stage(s)

    %{stage | heads: stage.heads * ways, headdim: min(headdim, @mma_headdim)}
  end

  # plan::state_stage: the call after PadState and StateHalves.
  defp state_stage(s) do
    halves = state_halves(s.dstate)

    %{
      s
      | heads: s.heads * halves,
        groups: s.groups * halves,
        dstate: div(mma_dstate(s.dstate) || s.dstate, halves)
    }
  end

  # plan::MmaWorkspace::new(s, backward).bytes: the widened state's arrays (PadState), the halves'
  # (StateHalves), the widened heads' (PadHeads), the split heads' (SplitHeads), then the kernels'.
  defp mma_workspace_bytes(s, backward) do
    stage = state_stage(s)
    widened = %{stage | headdim: mma_headdim(s.headdim) || s.headdim}

    arrays =
      aligned_sum(
        pad_state_arrays(s, backward) ++
          state_halves_arrays(s, backward) ++
          pad_heads_arrays(stage, backward) ++ split_heads_arrays(widened, backward)
      )

    m = mma_shape(s)
    kernels = if backward, do: mma_bwd_bytes(m), else: mma_fwd_bytes(m)

    cond do
      arrays == 0 -> kernels
      kernels == 0 -> arrays + @align
      true -> arrays + kernels
    end
  end

  # plan::PadState: B and C, the initial and final states and chunk_states at the kernels' dstate (in
  # the backward also dB, dC and the states' gradients); none at the kernels' dstates.
  defp pad_state_arrays(s, backward) do
    n = mma_dstate(s.dstate)

    if n == s.dstate do
      []
    else
      bc = s.batch * s.seqlen * s.groups * n * s.elem_bytes
      states = s.batch * s.heads * s.headdim * n * 4
      chunks = s.batch * s.heads * s.headdim * ceil_div(s.seqlen, s.chunk_size) * n * s.elem_bytes
      [bc, bc, states, states, chunks] ++ if(backward, do: [bc, bc, states, states], else: [])
    end
  end

  # plan::StateHalves: the halved call's x, z, dt, A, D, dt_bias, states and chunk states (forward
  # also y and the final states; backward dy, the gradients and dfinal_states); none unless halved.
  defp state_halves_arrays(s, backward) do
    halves = state_halves(s.dstate)

    if halves == 1 do
      []
    else
      heads = s.heads * halves
      n = List.last(@mma_dstates)
      per_step = s.batch * s.seqlen * heads * s.headdim * s.elem_bytes
      dt = s.batch * s.seqlen * heads * s.elem_bytes
      {per_head, d} = {heads * 4, heads * s.headdim * 4}
      states = s.batch * heads * s.headdim * n * 4
      chunks = s.batch * heads * s.headdim * ceil_div(s.seqlen, s.chunk_size) * n * s.elem_bytes
      both = [per_step, per_step, dt, per_head, d, per_head, states, chunks]

      if backward,
        do: both ++ [per_step, per_step, per_step, dt, per_head, d, per_head, states, states],
        else: both ++ [per_step, states]
    end
  end

  # plan::PadHeads (of the call after PadState and StateHalves): x, z, a per-channel D, the
  # states and chunk states at the widened headdim (forward also y and the final states; backward
  # dy, dx, dz, dD and the states' gradients); none for a multiple of 64.
  defp pad_heads_arrays(s, backward) do
    headdim = mma_headdim(s.headdim) || s.headdim

    if headdim == s.headdim do
      []
    else
      per_step = s.batch * s.seqlen * s.heads * headdim * s.elem_bytes
      d = s.heads * headdim * 4
      states = s.batch * s.heads * headdim * s.dstate * 4
      chunks = s.batch * s.heads * headdim * ceil_div(s.seqlen, s.chunk_size) * s.dstate * s.elem_bytes
      both = [per_step, per_step, d, states, chunks]

      if backward,
        do: both ++ [per_step, per_step, per_step, d, states, states],
        else: both ++ [per_step, states]
    end
  end

  # plan::SplitHeads: dt and A, D, dt_bias per split head (in the backward also their gradients);
  # none for headdim 64.
  defp split_heads_arrays(s, backward) do
    ways = max(div(s.headdim, @mma_headdim), 1)

    if ways == 1 do
      []
    else
      per_step = s.batch * s.seqlen * s.heads * ways * s.elem_bytes
      per_head = s.heads * ways * 4
      arrays = [per_step, per_head, per_head, per_head]
      if backward, do: arrays ++ arrays, else: arrays
    end
  end

  defp aligned_sum(sizes), do: sizes |> Enum.map(&(ceil_div(&1, @align) * @align)) |> Enum.sum()

  # plan::fwd_layout(..).bytes: per-channel scan inputs, then the scan's split workspace.
  defp generic_fwd_bytes(s) do
    dim = s.heads * s.headdim
    rows = s.batch * s.seqlen

    carve([
      rows * dim * s.elem_bytes,
      dim * s.dstate * 4,
      dim * 4,
      dim * 4,
      scan_fwd_bytes(s.batch, dim, s.seqlen, s.dstate)
    ])
  end

  # plan::bwd_layout(..).bytes.
  defp generic_bwd_bytes(s) do
    dim = s.heads * s.headdim
    rows = s.batch * s.seqlen

    carve([
      rows * dim * s.elem_bytes,
      dim * s.dstate * 4,
      dim * 4,
      dim * 4,
      rows * dim * s.elem_bytes,
      dim * s.dstate * 4,
      dim * 4,
      dim * 4,
      rows * s.heads * 4,
      scan_bwd_bytes(s.batch, dim, s.seqlen, s.dstate, s.groups)
    ])
  end

  # Carver: each array rounded up to ALIGN, plus ALIGN of slack for an unaligned start; nothing
  # at all when every array is empty.
  defp carve(sizes) do
    total = sizes |> Enum.map(&(ceil_div(max(&1, 0), @align) * @align)) |> Enum.sum()
    if total == 0, do: 0, else: total + @align
  end

  # plan::mma_fwd_bytes: records of the split, for whichever piece rule the GPU takes.
  defp mma_fwd_bytes(s) do
    records =
      [:fewest_tile_times, :one_wave]
      |> Enum.map(fn pieces -> mma_fwd_records(s, pieces) end)
      |> Enum.max()

    bytes = records * s.batch * s.heads * (s.headdim * s.dstate + 1) * 4
    if bytes == 0, do: 0, else: bytes + @align
  end

  # plan::mma_fwd_split(s, i64::MAX, pieces).records(): with no cap on records the cap drops out.
  defp mma_fwd_records(s, pieces) do
    bh = s.batch * s.heads
    n_tiles = ceil_div(s.seqlen, @mma_tile)
    planned = if bh == 0, do: 1, else: max(min(div(@mma_wave_blocks, bh), n_tiles), 1)
    tiles_per_part = max(ceil_div(n_tiles, planned), 1)
    n_parts = max(ceil_div(n_tiles, tiles_per_part), 1)
    records_per_part = max(local_records_per_part(bh, n_parts, tiles_per_part, pieces), 1)
    (n_parts - 1) * records_per_part
  end

  defp local_records_per_part(_bh, n_parts, _tiles_per_part, _pieces) when n_parts <= 1, do: 1

  defp local_records_per_part(bh, n_parts, tiles_per_part, pieces) do
    blocks = bh * (n_parts - 1)
    counts = Enum.to_list(1..min(tiles_per_part, @max_local_records))

    case pieces do
      :one_wave ->
        counts |> Enum.reverse() |> Enum.find(1, &(blocks * &1 <= @mma_wave_blocks))

      :fewest_tile_times ->
        # Enum.min_by keeps the first of equal minima, as Rust's Iterator::min_by_key does.
        Enum.min_by(counts, fn r ->
          waves = ceil_div(blocks * r, @mma_wave_blocks)
          waves * (ceil_div(tiles_per_part, r) + @local_block_tiles)
        end)
    end
  end

  # plan::mma_bwd_layout(..).bytes.
  defp mma_bwd_bytes(s) do
    bh = s.batch * s.heads
    n_chunks = ceil_div(s.seqlen, s.chunk_size)
    wanted = if bh == 0, do: 1, else: max(min(div(@mma_wave_blocks, bh), n_chunks), 1)
    chunks_per_part = max(ceil_div(n_chunks, wanted), 1)
    n_parts = max(ceil_div(n_chunks, chunks_per_part), 1)
    state = s.headdim * s.dstate
    head_sums = mma_bwd_head_sums?(s, n_chunks)
    used = fn bytes, used? -> if used?, do: bytes, else: 0 end
    tiles = div(s.chunk_size, @mma_tile)
    msum_split = max(min(@msum_max_split, div(s.heads, s.groups)), 1)

    msum_bytes =
      div(s.batch * n_chunks * s.groups * msum_split * tiles * (tiles + 1), 2) * @mma_tile *
        @mma_tile * 4

    chunk_state_bytes = used.(bh * n_chunks * state * 2, head_sums)
    part_bytes = used.(s.batch * s.seqlen * s.heads * s.dstate * 2, not head_sums)

    records_per_part =
      local_records_per_part(
        bh,
        n_parts,
        div(chunks_per_part * s.chunk_size, @mma_tile),
        :fewest_tile_times
      )

    carve([
      # gated
      s.batch * s.seqlen * s.heads * s.headdim * 2,
      # s_chunk, ds_chunk
      chunk_state_bytes,
      chunk_state_bytes,
      # scal
      used.(bh * n_chunks * s.chunk_size * 8, head_sums),
      # msum
      used.(msum_bytes, head_sums),
      # db_part, dc_part
      part_bytes,
      part_bytes,
      # scratch
      n_parts * bh * max(tiles - 3, 0) * state * 2,
      # da_part, dbias_part, dd_part
      n_parts * bh * 4,
      n_parts * bh * 4,
      n_parts * bh * s.headdim * 4,
      # records
      (n_parts - 1) * records_per_part * bh * (state + 1) * 4
    ])
  end

  defp mma_bwd_head_sums?(s, n_chunks) do
    s.dstate == 128 and s.chunk_size == 256 and div(s.heads, s.groups) >= 32 and
      s.batch * n_chunks * s.groups >= 64
  end

  ## helpers

  defp ceil_div(a, b), do: div(a + b - 1, b)

  # u64::next_power_of_two for n >= 1.
  defp next_power_of_two(n), do: next_power_of_two(n, 1)
  defp next_power_of_two(n, p) when p >= n, do: p
  defp next_power_of_two(n, p), do: next_power_of_two(n, p * 2)
end
