defmodule XlaSsm.Test.Fixture do
  @moduledoc """
  The golden fixture `test/fixtures/exla_calls.txt`: a fixed set of custom calls built by
  `XlaSsm.Spec` (every target, several shapes, with and without optional operands and
  workspaces, each dtype family), plus workspace sizes and `chunk_states` types of many shapes.

  `tests/suite/exla_frames.rs` (the Rust library's side) reads the file, builds each call's XLA FFI
  call frame from it (attributes parsed from their MLIR text as XLA would), runs the CPU handler,
  and compares every size with the library's own C functions.

  Format, one item per line (`#` starts a comment):

      call <id>
      target <xla target name>
      attr <name> <mlir text>           (the rest of the line)
      operand <name> <type> <dims...>   (in ABI order)
      result <name> <type> <dims...>    (in ABI order)
      workspace_bytes <n>               (what the CUDA target needs; the workspace result, if
                                         any, is that long)
      end
      size <function> <args...> = <bytes>
      chunk_states_type <headdim> <dstate> <chunk_size> <type> = <type>

  `size` functions: `selective_scan_fwd batch dim seqlen dstate`, `selective_scan_bwd batch dim
  seqlen dstate groups`, `ssd_fwd` / `ssd_bwd batch seqlen heads headdim dstate groups chunk_size
  type`.
  """

  alias XlaSsm.Spec
  alias XlaSsm.Spec.Workspace

  @path Path.expand("../fixtures/exla_calls.txt", __DIR__)

  @doc "Where the committed fixture lives."
  def path, do: @path

  @doc "The fixture's whole text."
  def render do
    header = """
    # Generated from XlaSsm.Spec by bindings/elixir/test/fixture_test.exs; do not edit.
    # Rewrite with: XLA_SSM_WRITE_FIXTURE=1 bash bindings/elixir/test/run_pure.sh
    # Checked against libxla_ssm by tests/suite/exla_frames.rs (format: test/support/fixture.ex).
    """

    calls = Enum.map_join(calls(), "\n", fn {id, call} -> render_call(id, call) end)
    header <> "\n" <> calls <> "\n" <> render_sizes() <> render_chunk_types()
  end

  defp render_call(id, %Spec.Call{} = call) do
    lines =
      ["call #{id}", "target #{call.target}"] ++
        Enum.map(call.attributes, fn {name, text} -> "attr #{name} #{text}" end) ++
        Enum.map(call.operands, &entry("operand", &1)) ++
        Enum.map(call.results, &entry("result", &1)) ++
        ["workspace_bytes #{call.workspace_bytes}", "end"]

    Enum.join(lines, "\n") <> "\n"
  end

  defp entry(kind, {name, shape, type}) do
    dims = shape |> Tuple.to_list() |> Enum.map(&Integer.to_string/1)
    Enum.join([kind, name, Spec.type_name(type) | dims], " ")
  end

  ## The calls

  @doc "The fixture's calls, `{id, %XlaSsm.Spec.Call{}}`, each small enough to run on the CPU."
  def calls do
    scan_calls() ++ ssd_calls() ++ decode_calls()
  end

  defp t(shape, type), do: {shape, type}

  defp scan_calls do
    # (batch, dim, seqlen, dstate)
    bdl = fn {b, d, l}, type -> t({b, d, l}, type) end
    bld = fn {b, d, l}, type -> t({b, l, d}, type) end

    f32_tv = %{
      u: bdl.({2, 8, 64}, :f32),
      delta: bdl.({2, 8, 64}, :f32),
      a: t({8, 16}, :f32),
      b: t({2, 1, 16, 64}, :f32),
      c: t({2, 1, 16, 64}, :f32)
    }

    # Long enough at batch x dim = 1 x 64 for the CUDA forward to split: a non-zero workspace.
    bf16_all = %{
      u: bld.({1, 64, 256}, :bf16),
      delta: bld.({1, 64, 256}, :bf16),
      a: t({64, 16}, :f32),
      b: t({1, 256, 2, 16}, :bf16),
      c: t({1, 256, 2, 16}, :bf16),
      d: t({64}, :f32),
      z: bld.({1, 64, 256}, :bf16),
      delta_bias: t({64}, :f32),
      initial_state: t({1, 64, 16}, :f32)
    }

    f16_ti = %{
      u: bdl.({3, 6, 33}, :f16),
      delta: bdl.({3, 6, 33}, :f16),
      a: t({6, 4}, :f32),
      b: t({6, 4}, :f32),
      c: t({6, 4}, :f32),
      d: t({6}, :f32),
      z: bdl.({3, 6, 33}, :f16)
    }

    f32_bld_h0 = %{
      u: bld.({1, 12, 200}, :f32),
      delta: bld.({1, 12, 200}, :f32),
      a: t({12, 40}, :f32),
      b: t({1, 200, 3, 40}, :f32),
      c: t({1, 200, 3, 40}, :f32),
      initial_state: t({1, 12, 40}, :f32)
    }

    bwd_f32 = %{
      u: bdl.({2, 8, 70}, :f32),
      delta: bdl.({2, 8, 70}, :f32),
      a: t({8, 16}, :f32),
      b: t({2, 2, 16, 70}, :f32),
      c: t({2, 2, 16, 70}, :f32),
      d: t({8}, :f32),
      z: bdl.({2, 8, 70}, :f32),
      delta_bias: t({8}, :f32),
      initial_state: t({2, 8, 16}, :f32),
      checkpoints: t({2, 8, 3, 16}, :f32),
      dout: bdl.({2, 8, 70}, :f32),
      dfinal_state: t({2, 8, 16}, :f32)
    }

    bwd_bf16_ti = %{
      u: bld.({2, 16, 100}, :bf16),
      delta: bld.({2, 16, 100}, :bf16),
      a: t({16, 8}, :f32),
      b: t({16, 8}, :bf16),
      c: t({16, 8}, :bf16),
      checkpoints: t({2, 16, 2, 8}, :f32),
      dout: bld.({2, 16, 100}, :bf16)
    }

    # Packed sequences (batch 1, cu_seqlens): states are (num_seqs, dim, dstate). dim != seqlen, so
    # that reading a call in the other layout never fits.
    packed_fwd_f32 = %{
      u: bdl.({1, 8, 100}, :f32),
      delta: bdl.({1, 8, 100}, :f32),
      a: t({8, 16}, :f32),
      b: t({1, 2, 16, 100}, :f32),
      c: t({1, 2, 16, 100}, :f32),
      d: t({8}, :f32),
      initial_state: t({4, 8, 16}, :f32),
      cu_seqlens: t({5}, :s32)
    }

    packed_fwd_bf16 = %{
      u: bld.({1, 16, 90}, :bf16),
      delta: bld.({1, 16, 90}, :bf16),
      a: t({16, 8}, :f32),
      b: t({1, 90, 1, 8}, :bf16),
      c: t({1, 90, 1, 8}, :bf16),
      z: bld.({1, 16, 90}, :bf16),
      delta_bias: t({16}, :f32),
      cu_seqlens: t({4}, :s32)
    }

    packed_bwd_f32 =
      %{packed_fwd_f32 | u: bld.({1, 8, 100}, :f32), delta: bld.({1, 8, 100}, :f32)}
      |> Map.merge(%{
        b: t({1, 100, 2, 16}, :f32),
        c: t({1, 100, 2, 16}, :f32),
        delta_bias: t({8}, :f32),
        checkpoints: t({1, 8, 4, 16}, :f32),
        dout: bld.({1, 8, 100}, :f32),
        dfinal_state: t({4, 8, 16}, :f32)
      })

    packed_bwd_bf16_ti = %{
      u: bdl.({1, 16, 90}, :bf16),
      delta: bdl.({1, 16, 90}, :bf16),
      a: t({16, 8}, :f32),
      b: t({16, 8}, :bf16),
      c: t({16, 8}, :bf16),
      z: bdl.({1, 16, 90}, :bf16),
      initial_state: t({3, 16, 8}, :f32),
      cu_seqlens: t({4}, :s32),
      checkpoints: t({1, 16, 3, 8}, :f32),
      dout: bdl.({1, 16, 90}, :bf16)
    }

    [
      {"scan_fwd_f32_bdl_minimal", Spec.selective_scan_fwd(f32_tv)},
      {"scan_fwd_f32_bdl_softplus_checkpoints",
       Spec.selective_scan_fwd(f32_tv, delta_softplus: true, checkpoint_len: 32)},
      {"scan_fwd_bf16_bld_all_optional_split",
       Spec.selective_scan_fwd(bf16_all, delta_softplus: true, layout: "bld", checkpoint_len: 64)},
      {"scan_fwd_bf16_bld_all_optional_no_workspace",
       Spec.selective_scan_fwd(bf16_all, layout: "bld", workspace: false)},
      {"scan_fwd_f16_time_invariant_f32_bc", Spec.selective_scan_fwd(f16_ti, delta_softplus: true)},
      {"scan_fwd_f32_bld_dstate40_initial_state", Spec.selective_scan_fwd(f32_bld_h0, layout: "bld")},
      {"scan_bwd_f32_bdl_all_optional", Spec.selective_scan_bwd(bwd_f32, delta_softplus: true, checkpoint_len: 32)},
      {"scan_bwd_bf16_bld_time_invariant", Spec.selective_scan_bwd(bwd_bf16_ti, layout: "bld", checkpoint_len: 64)},
      {"scan_bwd_bf16_bld_time_invariant_no_workspace",
       Spec.selective_scan_bwd(bwd_bf16_ti, layout: "bld", checkpoint_len: 64, workspace: false)},
      {"scan_fwd_f32_bdl_packed_initial_states_checkpoints",
       Spec.selective_scan_fwd(packed_fwd_f32, delta_softplus: true, checkpoint_len: 32)},
      {"scan_fwd_bf16_bld_packed_checkpoints",
       Spec.selective_scan_fwd(packed_fwd_bf16, layout: "bld", checkpoint_len: 32)},
      {"scan_bwd_f32_bld_packed_initial_and_final_states",
       Spec.selective_scan_bwd(packed_bwd_f32, layout: "bld", delta_softplus: true, checkpoint_len: 32)},
      {"scan_bwd_bf16_bdl_packed_time_invariant_initial_states",
       Spec.selective_scan_bwd(packed_bwd_bf16_ti, checkpoint_len: 32)}
    ]
  end

  defp ssd_calls do
    # (batch, seqlen, heads, headdim, dstate, groups)
    ssd_ops = fn {b, l, h, p, n, g}, type ->
      %{
        x: t({b, l, h, p}, type),
        dt: t({b, l, h}, type),
        a: t({h}, :f32),
        b: t({b, l, g, n}, type),
        c: t({b, l, g, n}, type)
      }
    end

    generic = {2, 77, 4, 16, 16, 2}

    f32_all =
      ssd_ops.(generic, :f32)
      |> Map.merge(%{
        d: t({4}, :f32),
        z: t({2, 77, 4, 16}, :f32),
        dt_bias: t({4}, :f32),
        initial_states: t({2, 4, 16, 16}, :f32)
      })

    # The tensor-core shape (bf16, headdim 64, dstate 64, chunk 64): chunk_states in bf16.
    mma = {1, 150, 2, 64, 64, 1}

    bf16_mma =
      ssd_ops.(mma, :bf16)
      |> Map.merge(%{d: t({2, 64}, :f32), initial_states: t({1, 2, 64, 64}, :f32)})

    f16_generic = ssd_ops.({1, 40, 2, 32, 128, 2}, :f16) |> Map.put(:z, t({1, 40, 2, 32}, :f16))

    bwd_f32 =
      f32_all
      |> Map.merge(%{
        chunk_states: t({2, 4, 16, 3, 16}, :f32),
        dy: t({2, 77, 4, 16}, :f32),
        dfinal_states: t({2, 4, 16, 16}, :f32)
      })

    bwd_bf16_mma =
      ssd_ops.(mma, :bf16)
      |> Map.merge(%{chunk_states: t({1, 2, 64, 3, 64}, :bf16), dy: t({1, 150, 2, 64}, :bf16)})

    [
      {"ssd_fwd_f32_generic_all_optional", Spec.ssd_fwd(f32_all, chunk_size: 32, dt_softplus: true)},
      {"ssd_fwd_bf16_tensor_core_clamp_chunk_states",
       Spec.ssd_fwd(bf16_mma, chunk_size: 64, dt_limit: {0.001, 0.1}, save_chunk_states: true)},
      {"ssd_fwd_f16_generic_upper_clamp",
       Spec.ssd_fwd(f16_generic,
         chunk_size: 128,
         dt_softplus: true,
         dt_limit: {:neg_infinity, 0.5},
         save_chunk_states: true
       )},
      {"ssd_fwd_f32_no_workspace", Spec.ssd_fwd(ssd_ops.(generic, :f32), chunk_size: 256, workspace: false)},
      {"ssd_bwd_f32_generic_all_optional",
       Spec.ssd_bwd(bwd_f32, chunk_size: 32, dt_softplus: true, dt_limit: {0.0, 2.5})},
      {"ssd_bwd_bf16_tensor_core", Spec.ssd_bwd(bwd_bf16_mma, chunk_size: 64)}
    ]
  end

  defp decode_calls do
    update_f32 = %{
      state: t({2, 8, 16}, :f32),
      x: t({2, 8}, :f32),
      dt: t({2, 8}, :f32),
      a: t({8, 16}, :f32),
      b: t({2, 1, 16}, :f32),
      c: t({2, 1, 16}, :f32)
    }

    # A pool of 5 slots for 3 rows; f32 state with bf16 inputs.
    update_bf16_pool = %{
      state: t({5, 12, 8}, :f32),
      x: t({3, 12}, :bf16),
      dt: t({3, 12}, :bf16),
      a: t({12, 8}, :f32),
      b: t({3, 3, 8}, :bf16),
      c: t({3, 3, 8}, :bf16),
      d: t({12}, :f32),
      z: t({3, 12}, :bf16),
      dt_bias: t({12}, :f32),
      state_batch_indices: t({3}, :s32)
    }

    conv_f32 = %{x: t({2, 8, 20}, :f32), weight: t({8, 4}, :f32), bias: t({8}, :f32)}

    conv_bf16_bld = %{
      x: t({2, 20, 8}, :bf16),
      weight: t({8, 3}, :f32),
      bias: t({8}, :f32),
      initial_states: t({2, 8, 2}, :bf16)
    }

    conv_bwd_f32 =
      conv_f32 |> Map.merge(%{dout: t({2, 8, 20}, :f32), initial_states: t({2, 8, 3}, :f32)})

    conv_bwd_f16 = %{x: t({1, 9, 4}, :f16), weight: t({4, 2}, :f16), dout: t({1, 9, 4}, :f16)}

    conv_packed_f32 = %{
      x: t({1, 30, 8}, :f32),
      weight: t({8, 4}, :f32),
      bias: t({8}, :f32),
      initial_states: t({4, 8, 3}, :f32),
      cu_seqlens: t({5}, :s32)
    }

    conv_packed_bwd_bf16 = %{
      x: t({1, 8, 25}, :bf16),
      weight: t({8, 3}, :f32),
      dout: t({1, 8, 25}, :bf16),
      cu_seqlens: t({4}, :s32)
    }

    conv_update_f32 = %{x: t({2, 8}, :f32), conv_state: t({2, 8, 3}, :f32), weight: t({8, 4}, :f32), bias: t({8}, :f32)}

    conv_update_bf16 = %{
      x: t({3, 2, 8}, :bf16),
      conv_state: t({4, 8, 2}, :bf16),
      weight: t({8, 3}, :bf16),
      state_batch_indices: t({3}, :s32)
    }

    step_f32 = %{
      x: t({3, 8}, :f32),
      conv_state: t({4, 8, 3}, :f32),
      conv_weight: t({8, 4}, :f32),
      ssm_state: t({4, 8, 16}, :f32),
      dt: t({3, 8}, :f32),
      a: t({8, 16}, :f32),
      b: t({3, 2, 16}, :f32),
      c: t({3, 2, 16}, :f32),
      conv_bias: t({8}, :f32),
      d: t({8}, :f32),
      z: t({3, 8}, :f32),
      dt_bias: t({8}, :f32),
      state_batch_indices: t({3}, :s32)
    }

    step_bf16 = %{
      x: t({2, 8}, :bf16),
      conv_state: t({2, 8, 3}, :bf16),
      conv_weight: t({8, 4}, :bf16),
      ssm_state: t({2, 8, 16}, :bf16),
      dt: t({2, 8}, :bf16),
      a: t({8, 16}, :f32),
      b: t({2, 1, 16}, :bf16),
      c: t({2, 1, 16}, :bf16)
    }

    [
      {"state_update_f32_minimal", Spec.selective_state_update(update_f32)},
      {"state_update_bf16_pool_all_optional", Spec.selective_state_update(update_bf16_pool, dt_softplus: true)},
      {"conv_fwd_f32_bdl_silu_bias", Spec.causal_conv1d_fwd(conv_f32, silu: true)},
      {"conv_fwd_bf16_bld_f32_weight_initial_states", Spec.causal_conv1d_fwd(conv_bf16_bld, layout: "bld")},
      {"conv_bwd_f32_bdl_all_optional", Spec.causal_conv1d_bwd(conv_bwd_f32, silu: true)},
      {"conv_bwd_f16_bld_minimal", Spec.causal_conv1d_bwd(conv_bwd_f16, layout: "bld")},
      {"conv_fwd_f32_bld_packed_all_optional", Spec.causal_conv1d_fwd(conv_packed_f32, layout: "bld", silu: true)},
      {"conv_bwd_f32_bld_packed_all_optional",
       Spec.causal_conv1d_bwd(Map.put(conv_packed_f32, :dout, t({1, 30, 8}, :f32)), layout: "bld", silu: true)},
      {"conv_bwd_bf16_bdl_packed_f32_weight", Spec.causal_conv1d_bwd(conv_packed_bwd_bf16)},
      {"conv_update_f32_one_token_bias", Spec.causal_conv1d_update(conv_update_f32, silu: true)},
      {"conv_update_bf16_bld_tokens_pool", Spec.causal_conv1d_update(conv_update_bf16, layout: "bld")},
      {"decode_step_f32_pool_all_optional", Spec.mamba_decode_step(step_f32, dt_softplus: true)},
      {"decode_step_bf16_minimal", Spec.mamba_decode_step(step_bf16)}
    ]
  end

  ## Sizes: many shapes, including ones too large to run, for the ported formulas

  defp render_sizes do
    scan_fwd =
      for batch <- [0, 1, 2, 8],
          dim <- [1, 64, 1536, 4096],
          seqlen <- [0, 100, 128, 2048, 16384],
          dstate <- [1, 16, 256, 257] do
        size_line(
          "selective_scan_fwd",
          [batch, dim, seqlen, dstate],
          Workspace.selective_scan_fwd_bytes(batch, dim, seqlen, dstate)
        )
      end

    scan_bwd =
      for batch <- [1, 8],
          dim <- [64, 1536],
          seqlen <- [0, 33, 2048, 16384],
          dstate <- [1, 16, 256],
          groups <- [0, 1, 3, 4] do
        size_line(
          "selective_scan_bwd",
          [batch, dim, seqlen, dstate, groups],
          Workspace.selective_scan_bwd_bytes(batch, dim, seqlen, dstate, groups)
        )
      end

    # Negative sizes: the C functions clamp them to 0.
    clamped = [
      size_line("selective_scan_fwd", [-1, 64, 4096, 16], Workspace.selective_scan_fwd_bytes(-1, 64, 4096, 16)),
      size_line("selective_scan_bwd", [1, 64, 4096, -16, 1], Workspace.selective_scan_bwd_bytes(1, 64, 4096, -16, 1))
    ]

    ssd_shapes = [
      # the benchmarks' Mamba-2 shapes (tensor cores in bf16/f16)
      {8, 2048, 64, 64, 128, 1, 256},
      {1, 16384, 64, 64, 128, 1, 256},
      {2, 8192, 64, 64, 128, 1, 256},
      {1, 4096, 64, 64, 128, 1, 256},
      {1, 32768, 64, 64, 128, 1, 256},
      # head sums in the backward (32+ heads per group, 64+ units)
      {1, 64 * 256 - 3, 64, 64, 128, 2, 256},
      {1, 31 * 256, 64, 64, 128, 2, 256},
      {1, 16384, 64, 64, 128, 4, 256},
      {1, 16384, 16, 64, 128, 1, 256},
      {1, 16384, 8, 64, 128, 1, 256},
      {1, 8192, 4, 64, 128, 1, 256},
      {2, 333, 6, 64, 128, 3, 256},
      {1, 768, 1, 64, 128, 1, 256},
      {1, 16384, 64, 64, 64, 1, 256},
      {1, 16384, 64, 64, 128, 1, 128},
      {3, 5000, 4, 64, 64, 2, 64},
      {1, 100, 2, 64, 64, 1, 64},
      {2, 0, 2, 64, 64, 1, 64},
      {1, 1, 2, 64, 128, 1, 256},
      # a state of two halves (dstate 129 to 256), with split heads
      {8, 2048, 64, 64, 256, 1, 256},
      {1, 16384, 64, 64, 256, 1, 256},
      {1, 700, 2, 64, 200, 1, 128},
      {3, 130, 3, 128, 256, 3, 64},
      # heads widened to a multiple of 64, with split heads, a widened state, two halves
      {8, 2048, 64, 48, 128, 1, 256},
      {8, 2048, 128, 32, 128, 1, 256},
      {3, 130, 3, 96, 128, 3, 64},
      {2, 500, 4, 40, 16, 1, 256},
      {1, 1087, 8, 32, 256, 2, 256},
      # generic path: other headdim / dstate / chunk
      {8, 2048, 64, 16, 128, 1, 256},
      {2, 33, 6, 5, 7, 3, 32},
      {2, 77, 4, 16, 16, 2, 32},
      {1, 16384, 32, 64, 16, 1, 32},
      {0, 100, 4, 16, 16, 2, 64},
      {2, 100, 0, 16, 16, 1, 64},
      # refused: groups 0 or not dividing heads, negative sizes
      {2, 33, 6, 5, 7, 4, 32},
      {2, 33, 6, 5, 7, 0, 32},
      {2, -1, 6, 5, 7, 3, 32}
    ]

    ssd =
      for shape <- ssd_shapes,
          type <- [:f32, :bf16, :f16],
          {name, fun} <- [{"ssd_fwd", &Workspace.ssd_fwd_bytes/8}, {"ssd_bwd", &Workspace.ssd_bwd_bytes/8}] do
        args = Tuple.to_list(shape)
        nx_type = Spec.normalize_type(type)
        size_line(name, args ++ [type], apply(fun, args ++ [nx_type]))
      end

    "# Workspace sizes (the library's xla_ssm_*_workspace_bytes).\n" <>
      Enum.join(scan_fwd ++ scan_bwd ++ clamped ++ ssd, "\n") <> "\n"
  end

  defp size_line(name, args, bytes), do: "size #{name} #{Enum.join(args, " ")} = #{bytes}"

  defp render_chunk_types do
    lines =
      for headdim <- [16, 32, 64],
          dstate <- [16, 64, 128, 200, 256],
          chunk <- [32, 64, 128, 256],
          type <- [:f32, :bf16, :f16] do
        got = Workspace.ssd_chunk_states_type(headdim, dstate, chunk, Spec.normalize_type(type))
        "chunk_states_type #{headdim} #{dstate} #{chunk} #{type} = #{Spec.type_name(got)}"
      end

    "# chunk_states types (the library's xla_ssm_ssd_chunk_states_dtype).\n" <> Enum.join(lines, "\n") <> "\n"
  end
end
