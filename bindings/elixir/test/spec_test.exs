defmodule XlaSsm.SpecTest do
  # Pure Elixir: runs with `mix test` and without Nx/EXLA through test/run_pure.sh.
  use ExUnit.Case, async: true

  alias XlaSsm.Spec
  alias XlaSsm.Spec.{Attr, Workspace}

  doctest XlaSsm.Spec.Attr
  doctest XlaSsm.Spec, only: [normalize_type: 1]

  defp t(shape, type), do: {shape, type}

  defp scan_ops(type \\ :f32) do
    %{
      u: t({2, 8, 64}, type),
      delta: t({2, 8, 64}, type),
      a: t({8, 16}, :f32),
      b: t({2, 1, 16, 64}, type),
      c: t({2, 1, 16, 64}, type)
    }
  end

  # Three sequences packed along seqlen of one batch row.
  defp packed_ops do
    %{
      u: t({1, 8, 64}, :f32),
      delta: t({1, 8, 64}, :f32),
      a: t({8, 16}, :f32),
      b: t({1, 1, 16, 64}, :f32),
      c: t({1, 1, 16, 64}, :f32),
      initial_state: t({3, 8, 16}, :f32),
      cu_seqlens: t({4}, :s32)
    }
  end

  defp ssd_ops(type \\ :f32) do
    %{
      x: t({2, 77, 4, 16}, type),
      dt: t({2, 77, 4}, type),
      a: t({4}, :f32),
      b: t({2, 77, 2, 16}, type),
      c: t({2, 77, 2, 16}, type)
    }
  end

  defp names(entries), do: Enum.map(entries, &elem(&1, 0))

  describe "MLIR attribute text" do
    test "bools are MLIR's true/false (parsed as i1, a PRED scalar)" do
      assert Attr.bool(true) == "true"
      assert Attr.bool(false) == "false"
      assert_raise ArgumentError, fn -> Attr.bool(1) end
    end

    test "integers are i64" do
      assert Attr.i64(0) == "0 : i64"
      assert Attr.i64(-7) == "-7 : i64"
      assert Attr.i64(9_223_372_036_854_775_807) == "9223372036854775807 : i64"
      assert_raise ArgumentError, fn -> Attr.i64(9_223_372_036_854_775_808) end
      assert_raise ArgumentError, fn -> Attr.i64(1.0) end
    end

    test "floats always carry a decimal point or an exponent, shortest round-trip digits" do
      assert Attr.f32(0) == "0.0 : f32"
      assert Attr.f32(0.1) == "0.1 : f32"
      assert Attr.f32(-2.5) == "-2.5 : f32"
      assert Attr.f32(1) == "1.0 : f32"
      assert Attr.f32(1.0e-5) == "1.0e-5 : f32"
      assert Attr.f32(3.0e38) == "3.0e38 : f32"
    end

    test "infinities are hex f32 bit patterns; values past f32's range are refused" do
      assert Attr.f32(:infinity) == "0x7F800000 : f32"
      assert Attr.f32(:neg_infinity) == "0xFF800000 : f32"
      assert_raise ArgumentError, ~r/does not fit an f32/, fn -> Attr.f32(1.0e39) end
      assert_raise ArgumentError, fn -> Attr.f32(:nan) end
    end

    test "strings are quoted, with quotes, backslashes and control bytes escaped" do
      assert Attr.string("bld") == ~s("bld")
      assert Attr.string(~s(a"b\\c)) == ~S("a\"b\\c")
      assert Attr.string("x\ny") == ~S("x\0Ay")
    end
  end

  describe "selective_scan_fwd" do
    test "required operands only: attributes, results, no checkpoint_len" do
      call = Spec.selective_scan_fwd(scan_ops())
      assert call.target == "xla_ssm_selective_scan_fwd"
      assert names(call.operands) == ~w(u delta A B C)

      assert call.attributes == [
               {"delta_softplus", "false"},
               {"has_d", "false"},
               {"has_z", "false"},
               {"has_delta_bias", "false"},
               {"has_initial_state", "false"},
               {"layout", ~s("bdl")}
             ]

      assert call.results == [{"out", {2, 8, 64}, {:f, 32}}, {"final_state", {2, 8, 16}, {:f, 32}}]
      assert call.workspace_bytes == 0
    end

    test "optional operands follow in ABI order whatever the map order; checkpoints and workspace" do
      ops =
        [
          initial_state: t({1, 64, 16}, :f32),
          z: t({1, 256, 64}, :bf16),
          u: t({1, 256, 64}, :bf16),
          delta_bias: t({64}, :f32),
          delta: t({1, 256, 64}, :bf16),
          a: t({64, 16}, :f32),
          b: t({1, 256, 2, 16}, :bf16),
          c: t({1, 256, 2, 16}, :bf16),
          d: t({64}, :f32)
        ]

      call = Spec.selective_scan_fwd(ops, layout: :bld, delta_softplus: true, checkpoint_len: 96)
      assert names(call.operands) == ~w(u delta A B C D z delta_bias initial_state)

      assert Enum.all?(
               ~w(has_d has_z has_delta_bias has_initial_state delta_softplus),
               &({&1, "true"} in call.attributes)
             )

      assert {"layout", ~s("bld")} in call.attributes
      assert List.last(call.attributes) == {"checkpoint_len", "96 : i64"}
      # 1 x 64 channels over 256 steps: the CUDA forward splits (13056 bytes, worked by hand).
      assert call.workspace_bytes == 13_056

      assert call.results == [
               {"out", {1, 256, 64}, {:bf, 16}},
               {"final_state", {1, 64, 16}, {:f, 32}},
               {"checkpoints", {1, 64, 3, 16}, {:f, 32}},
               {"workspace", {13_056}, {:u, 8}}
             ]

      no_ws = Spec.selective_scan_fwd(ops, layout: "bld", workspace: false)
      assert names(no_ws.results) == ~w(out final_state)
      assert no_ws.workspace_bytes == 13_056
    end

    test "time-invariant B/C (rank 2), f32 next to f16 inputs" do
      ops = %{scan_ops(:f16) | b: t({8, 16}, :f32), c: t({8, 16}, :f32)}
      call = Spec.selective_scan_fwd(ops)
      assert {"B", {8, 16}, {:f, 32}} in call.operands
      assert {"out", {2, 8, 64}, {:f, 16}} in call.results
    end

    test "bad operands raise naming the operand" do
      bad = [
        {%{scan_ops() | delta: t({2, 8, 63}, :f32)}, ~r/operand `delta` must have shape \{2, 8, 64\}/},
        {%{scan_ops() | delta: t({2, 8, 64}, :bf16)}, ~r/operand `delta` must be f32, got bf16/},
        {%{scan_ops() | u: t({2, 8}, :f32)}, ~r/operand `u` must have rank 3/},
        {%{scan_ops() | a: t({7, 16}, :f32)}, ~r/operand `A` must have shape \(dim = 8, dstate\)/},
        {%{scan_ops() | a: t({8, 300}, :f32)}, ~r/dstate .* at most 256/},
        {%{scan_ops() | b: t({2, 3, 16, 64}, :f32), c: t({2, 3, 16, 64}, :f32)},
         ~r/groups \(3\) must be at least 1 and divide dim \(8\)/},
        {%{scan_ops() | c: t({2, 1, 16, 64}, :bf16)}, ~r/operand `C` must be f32/},
        {%{scan_ops() | b: t({2, 16, 64}, :f32)}, ~r/operand `B` must have rank 2 .* or rank 4/},
        {Map.put(scan_ops(), :d, t({9}, :f32)), ~r/operand `D` must have shape \{8\}/},
        {Map.put(scan_ops(), :initial_state, t({2, 8, 16}, :bf16)), ~r/operand `initial_state` must be f32/},
        {Map.delete(scan_ops(), :c), ~r/missing operands \[:c\]/},
        {Map.put(scan_ops(), :zz, t({1}, :f32)), ~r/unknown operands \[:zz\]/},
        {%{scan_ops() | u: t({2, 8, 64}, :f64)}, ~r/operand :u: unsupported type/}
      ]

      for {ops, message} <- bad do
        assert_raise ArgumentError, message, fn -> Spec.selective_scan_fwd(ops) end
      end
    end

    test "packed sequences: cu_seqlens after initial_state, one state per sequence, has_cu_seqlens only then" do
      ops = packed_ops()
      call = Spec.selective_scan_fwd(ops, checkpoint_len: 32)
      assert names(call.operands) == ~w(u delta A B C initial_state cu_seqlens)
      assert {"cu_seqlens", {4}, {:s, 32}} in call.operands
      assert {"has_cu_seqlens", "true"} in call.attributes
      assert List.last(call.attributes) == {"checkpoint_len", "32 : i64"}

      assert call.results == [
               {"out", {1, 8, 64}, {:f, 32}},
               {"final_state", {3, 8, 16}, {:f, 32}},
               {"checkpoints", {1, 8, 2, 16}, {:f, 32}}
             ]

      # The workspace depends on the shape only, as without packing.
      assert call.workspace_bytes == Workspace.selective_scan_fwd_bytes(1, 8, 64, 16)

      # Without cu_seqlens (or with nil) the call is the unpacked one, attribute and all.
      unpacked = ops |> Map.delete(:cu_seqlens) |> Map.put(:initial_state, t({1, 8, 16}, :f32))
      plain = Spec.selective_scan_fwd(unpacked)
      refute Enum.any?(plain.attributes, fn {name, _} -> name == "has_cu_seqlens" end)
      assert Spec.selective_scan_fwd(Map.put(unpacked, :cu_seqlens, nil)) == plain
      assert {"final_state", {1, 8, 16}, {:f, 32}} in plain.results
      # Packed without initial states: final_state still has one row per sequence.
      no_h0 = Spec.selective_scan_fwd(Map.delete(ops, :initial_state), layout: "bdl")
      assert names(no_h0.operands) == ~w(u delta A B C cu_seqlens)
      assert {"final_state", {3, 8, 16}, {:f, 32}} in no_h0.results
      assert {"has_initial_state", "false"} in no_h0.attributes
    end

    test "bad cu_seqlens and states of packed calls raise naming the operand" do
      bad = [
        {%{packed_ops() | cu_seqlens: t({4}, :f32)}, ~r/operand `cu_seqlens` must be s32, got f32/},
        {%{packed_ops() | cu_seqlens: t({4, 1}, :s32)}, ~r/operand `cu_seqlens` must have rank 1/},
        {%{packed_ops() | cu_seqlens: t({0}, :s32)}, ~r/operand `cu_seqlens` .* at least one boundary/},
        {%{
           packed_ops()
           | u: t({2, 8, 64}, :f32),
             delta: t({2, 8, 64}, :f32),
             b: t({2, 1, 16, 64}, :f32),
             c: t({2, 1, 16, 64}, :f32)
         }, ~r/operand `cu_seqlens`: .*u's batch must be 1, got 2/},
        {%{packed_ops() | initial_state: t({1, 8, 16}, :f32)},
         ~r/operand `initial_state` must have shape \{3, 8, 16\} \(num_seqs, dim, dstate\)/},
        {%{packed_ops() | cu_seqlens: t({2}, :s32)}, ~r/operand `initial_state` must have shape \{1, 8, 16\}/},
        {%{packed_ops() | cu_seqlens: {{4}, :f64}}, ~r/operand :cu_seqlens: unsupported type/}
      ]

      for {ops, message} <- bad do
        assert_raise ArgumentError, message, fn -> Spec.selective_scan_fwd(ops) end
      end
    end

    test "bad options raise" do
      assert_raise ArgumentError, ~r/:checkpoint_len must be 0 \(none\) or a positive multiple of 32/, fn ->
        Spec.selective_scan_fwd(scan_ops(), checkpoint_len: 48)
      end

      assert_raise ArgumentError, ~r/:layout must be "bdl" or "bld"/, fn ->
        Spec.selective_scan_fwd(scan_ops(), layout: "ldb")
      end

      assert_raise ArgumentError, ~r/unknown options \[:softplus\]/, fn ->
        Spec.selective_scan_fwd(scan_ops(), softplus: true)
      end

      assert_raise ArgumentError, ~r/:delta_softplus must be a boolean/, fn ->
        Spec.selective_scan_fwd(scan_ops(), delta_softplus: 1)
      end
    end
  end

  describe "selective_scan_bwd" do
    test "operands, gradients in the primals' shapes and types, attributes" do
      ops =
        scan_ops(:bf16)
        |> Map.merge(%{
          z: t({2, 8, 64}, :bf16),
          d: t({8}, :f32),
          checkpoints: t({2, 8, 2, 16}, :f32),
          dout: t({2, 8, 64}, :bf16)
        })

      call = Spec.selective_scan_bwd(ops, checkpoint_len: 32)
      assert names(call.operands) == ~w(u delta A B C D z checkpoints dout)
      assert names(call.results) == ~w(du ddelta dA dB dC dD dz workspace)
      assert {"dB", {2, 1, 16, 64}, {:bf, 16}} in call.results
      assert {"dD", {8}, {:f, 32}} in call.results
      assert {"checkpoint_len", "32 : i64"} in call.attributes
      assert {"has_dfinal_state", "false"} in call.attributes
      assert call.workspace_bytes == Workspace.selective_scan_bwd_bytes(2, 8, 64, 16, 1)
      assert call.workspace_bytes > 0

      with_dfinal = Spec.selective_scan_bwd(Map.put(ops, :dfinal_state, t({2, 8, 16}, :f32)), checkpoint_len: 32)
      assert List.last(names(with_dfinal.operands)) == "dfinal_state"
      assert {"has_dfinal_state", "true"} in with_dfinal.attributes
    end

    test "packed: cu_seqlens before the cotangents, no gradient of it, states per sequence" do
      ops =
        packed_ops()
        |> Map.merge(%{
          checkpoints: t({1, 8, 2, 16}, :f32),
          dout: t({1, 8, 64}, :f32),
          dfinal_state: t({3, 8, 16}, :f32)
        })

      call = Spec.selective_scan_bwd(ops, checkpoint_len: 32)
      assert names(call.operands) == ~w(u delta A B C initial_state cu_seqlens checkpoints dout dfinal_state)
      assert names(call.results) == ~w(du ddelta dA dB dC dinitial_state workspace)
      assert {"dinitial_state", {3, 8, 16}, {:f, 32}} in call.results
      assert {"has_cu_seqlens", "true"} in call.attributes
      assert {"has_dfinal_state", "true"} in call.attributes
      assert call.workspace_bytes == Workspace.selective_scan_bwd_bytes(1, 8, 64, 16, 1)

      assert_raise ArgumentError,
                   ~r/operand `dfinal_state` must have shape \{3, 8, 16\} \(num_seqs, dim, dstate\)/,
                   fn ->
                     Spec.selective_scan_bwd(%{ops | dfinal_state: t({1, 8, 16}, :f32)}, checkpoint_len: 32)
                   end

      # Checkpoints stay per batch row (one), not per sequence.
      assert_raise ArgumentError, ~r/operand `checkpoints` must have shape \{1, 8, 2, 16\}/, fn ->
        Spec.selective_scan_bwd(%{ops | checkpoints: t({3, 8, 2, 16}, :f32)}, checkpoint_len: 32)
      end

      unpacked =
        ops |> Map.drop([:cu_seqlens, :dfinal_state]) |> Map.put(:initial_state, t({1, 8, 16}, :f32))

      refute Enum.any?(
               Spec.selective_scan_bwd(unpacked, checkpoint_len: 32).attributes,
               &(elem(&1, 0) == "has_cu_seqlens")
             )
    end

    test "checkpoints must match checkpoint_len, which is required" do
      ops = Map.merge(scan_ops(), %{checkpoints: t({2, 8, 2, 16}, :f32), dout: t({2, 8, 64}, :f32)})

      assert_raise ArgumentError, ~r/operand `checkpoints` must have shape \{2, 8, 1, 16\}/, fn ->
        Spec.selective_scan_bwd(ops, checkpoint_len: 64)
      end

      assert_raise ArgumentError, ~r/:checkpoint_len must be a positive multiple of 32, got nil/, fn ->
        Spec.selective_scan_bwd(ops, [])
      end

      assert_raise ArgumentError, ~r/operand `dout` must be f32/, fn ->
        Spec.selective_scan_bwd(%{ops | dout: t({2, 8, 64}, :f16)}, checkpoint_len: 32)
      end
    end
  end

  describe "ssd" do
    test "forward: attributes in the JAX binding's order, default dt_limit means no clamp" do
      call = Spec.ssd_fwd(ssd_ops(), chunk_size: 32)

      assert call.attributes == [
               {"chunk_size", "32 : i64"},
               {"has_d", "false"},
               {"has_z", "false"},
               {"has_dt_bias", "false"},
               {"has_initial_states", "false"},
               {"dt_softplus", "false"},
               {"dt_min", "0xFF800000 : f32"},
               {"dt_max", "0x7F800000 : f32"},
               {"save_chunk_states", "false"}
             ]

      assert names(call.results) == ~w(y final_states workspace)
      assert {"final_states", {2, 4, 16, 16}, {:f, 32}} in call.results
    end

    test "chunk_states: T on the tensor-core shapes, f32 elsewhere" do
      mma = %{
        x: t({1, 150, 2, 64}, :bf16),
        dt: t({1, 150, 2}, :bf16),
        a: t({2}, :f32),
        b: t({1, 150, 1, 64}, :bf16),
        c: t({1, 150, 1, 64}, :bf16)
      }

      call = Spec.ssd_fwd(mma, chunk_size: 64, save_chunk_states: true, dt_limit: {0.001, 0.1})
      assert {"chunk_states", {1, 2, 64, 3, 64}, {:bf, 16}} in call.results
      assert {"dt_min", "0.001 : f32"} in call.attributes
      assert {"dt_max", "0.1 : f32"} in call.attributes

      generic = Spec.ssd_fwd(mma, chunk_size: 32, save_chunk_states: true)
      assert {"chunk_states", {1, 2, 64, 5, 64}, {:f, 32}} in generic.results
    end

    test "backward: chunk_states of the wrong type are refused, gradients follow the primals" do
      ops =
        ssd_ops(:bf16)
        |> Map.merge(%{
          d: t({4, 16}, :f32),
          dt_bias: t({4}, :f32),
          chunk_states: t({2, 4, 16, 3, 16}, :f32),
          dy: t({2, 77, 4, 16}, :bf16)
        })

      call = Spec.ssd_bwd(ops, chunk_size: 32)
      assert names(call.operands) == ~w(x dt A B C D dt_bias chunk_states dy)
      assert names(call.results) == ~w(dx ddt dA dB dC dD ddt_bias workspace)
      assert {"dD", {4, 16}, {:f, 32}} in call.results
      assert {"has_dfinal_states", "false"} in call.attributes
      refute Enum.any?(call.attributes, &(elem(&1, 0) == "save_chunk_states"))

      assert_raise ArgumentError, ~r/operand `chunk_states` must be f32, got bf16/, fn ->
        Spec.ssd_bwd(%{ops | chunk_states: t({2, 4, 16, 3, 16}, :bf16)}, chunk_size: 32)
      end
    end

    test "bad operands and options raise" do
      bad = [
        {[], %{ssd_ops() | dt: t({2, 77, 3}, :f32)}, ~r/operand `dt` must have shape \{2, 77, 4\}/},
        {[], %{ssd_ops() | b: t({2, 77, 3, 16}, :f32), c: t({2, 77, 3, 16}, :f32)},
         ~r/groups \(3\) must be at least 1 and divide heads \(4\)/},
        {[], %{ssd_ops() | b: t({2, 77, 2, 0}, :f32), c: t({2, 77, 2, 0}, :f32)}, ~r/dstate must be in \[1, 256\]/},
        {[], Map.put(ssd_ops(), :d, t({4, 15}, :f32)), ~r/operand `D` must have shape \(heads\)/},
        {[], %{ssd_ops() | a: t({4}, :bf16)}, ~r/operand `A` must be f32/},
        {[chunk_size: 100], ssd_ops(), ~r/:chunk_size must be one of \[32, 64, 128, 256\]/},
        {[dt_limit: {0.5, 0.1}], ssd_ops(), ~r/:dt_limit must be \{dt_min, dt_max\} with dt_min <= dt_max/},
        {[dt_limit: {:infinity, :infinity}], ssd_ops(), ~r/:dt_limit/},
        {[dt_limit: 0.5], ssd_ops(), ~r/:dt_limit must be a \{dt_min, dt_max\} tuple/}
      ]

      for {opts, ops, message} <- bad do
        assert_raise ArgumentError, message, fn -> Spec.ssd_fwd(ops, opts) end
      end
    end

    test "effective_dt_limit" do
      assert Spec.effective_dt_limit({0.0, :infinity}) == {:neg_infinity, :infinity}
      assert Spec.effective_dt_limit({0, :infinity}) == {:neg_infinity, :infinity}
      assert Spec.effective_dt_limit({0.001, :infinity}) == {0.001, :infinity}
      assert Spec.effective_dt_limit({0.0, 10.0}) == {0.0, 10.0}
    end
  end

  describe "decode targets" do
    test "selective_state_update with a pool: state first, indices last, no workspace" do
      ops = %{
        state: t({5, 12, 8}, :f32),
        x: t({3, 12}, :bf16),
        dt: t({3, 12}, :bf16),
        a: t({12, 8}, :f32),
        b: t({3, 3, 8}, :bf16),
        c: t({3, 3, 8}, :bf16),
        state_batch_indices: t({3}, :s32)
      }

      call = Spec.selective_state_update(ops, dt_softplus: true)
      assert names(call.operands) == ~w(state x dt A B C state_batch_indices)
      assert call.results == [{"out", {3, 12}, {:bf, 16}}, {"state", {5, 12, 8}, {:f, 32}}]
      assert {"has_state_batch_indices", "true"} in call.attributes

      assert_raise ArgumentError, ~r/operand `state` must have shape \{3, 12, 8\}/, fn ->
        Spec.selective_state_update(Map.delete(ops, :state_batch_indices))
      end

      assert_raise ArgumentError, ~r/operand `state_batch_indices` must be s32/, fn ->
        Spec.selective_state_update(%{ops | state_batch_indices: t({3}, :f32)})
      end
    end

    test "causal_conv1d fwd/bwd/update" do
      fwd =
        Spec.causal_conv1d_fwd(%{x: t({2, 20, 8}, :bf16), weight: t({8, 3}, :f32), initial_states: t({2, 8, 2}, :bf16)},
          layout: "bld",
          silu: true
        )

      assert names(fwd.operands) == ~w(x weight initial_states)
      assert fwd.results == [{"out", {2, 20, 8}, {:bf, 16}}]

      assert fwd.attributes == [
               {"silu", "true"},
               {"layout", ~s("bld")},
               {"has_bias", "false"},
               {"has_initial_states", "true"}
             ]

      bwd =
        Spec.causal_conv1d_bwd(%{
          x: t({2, 8, 20}, :f32),
          weight: t({8, 4}, :f32),
          dout: t({2, 8, 20}, :f32),
          bias: t({8}, :f32)
        })

      assert names(bwd.operands) == ~w(x weight dout bias)
      assert names(bwd.results) == ~w(dx dweight dbias)

      upd = Spec.causal_conv1d_update(%{x: t({2, 8}, :f32), conv_state: t({2, 8, 3}, :f32), weight: t({8, 4}, :f32)})
      assert upd.results == [{"out", {2, 8}, {:f, 32}}, {"conv_state", {2, 8, 3}, {:f, 32}}]

      assert_raise ArgumentError, ~r/operand `weight` must have shape \(dim = 8, width\) with width in 2..4/, fn ->
        Spec.causal_conv1d_fwd(%{x: t({2, 8, 20}, :f32), weight: t({8, 5}, :f32)})
      end

      assert_raise ArgumentError, ~r/operand `bias` must be bf16/, fn ->
        Spec.causal_conv1d_fwd(%{x: t({2, 8, 20}, :bf16), weight: t({8, 4}, :bf16), bias: t({8}, :f32)})
      end

      assert_raise ArgumentError, ~r/operand `x` must have rank 3/, fn ->
        Spec.causal_conv1d_fwd(%{x: t({2, 8}, :f32), weight: t({8, 4}, :f32)})
      end
    end

    test "causal_conv1d packed sequences" do
      ops = %{x: t({1, 30, 8}, :f32), weight: t({8, 4}, :f32), initial_states: t({3, 8, 3}, :f32), cu_seqlens: t({4}, :s32)}
      fwd = Spec.causal_conv1d_fwd(ops, layout: "bld")
      assert names(fwd.operands) == ~w(x weight initial_states cu_seqlens)
      assert {"has_cu_seqlens", "true"} in fwd.attributes

      bwd = Spec.causal_conv1d_bwd(Map.put(ops, :dout, t({1, 30, 8}, :f32)), layout: "bld")
      assert names(bwd.operands) == ~w(x weight dout initial_states cu_seqlens)
      assert bwd.results |> Enum.map(&elem(&1, 1)) == [{1, 30, 8}, {8, 4}, {3, 8, 3}]

      unpacked = Spec.causal_conv1d_fwd(%{x: t({1, 8, 30}, :f32), weight: t({8, 4}, :f32)})
      refute Enum.any?(unpacked.attributes, fn {name, _} -> name == "has_cu_seqlens" end)

      assert_raise ArgumentError, ~r/operand `initial_states` must have shape \{4, 8, 3\} \(num_seqs/, fn ->
        Spec.causal_conv1d_fwd(%{ops | cu_seqlens: t({5}, :s32)}, layout: "bld")
      end

      assert_raise ArgumentError, ~r/x's batch must be 1, got 2/, fn ->
        Spec.causal_conv1d_fwd(%{ops | x: t({2, 30, 8}, :f32), initial_states: nil}, layout: "bld")
      end

      assert_raise ArgumentError, ~r/operand `cu_seqlens` must be s32/, fn ->
        Spec.causal_conv1d_fwd(%{ops | cu_seqlens: t({4}, :f32)}, layout: "bld")
      end

      assert_raise ArgumentError, ~r/operand `cu_seqlens` must have shape \(num_seqs \+ 1\)/, fn ->
        Spec.causal_conv1d_fwd(%{ops | cu_seqlens: t({0}, :s32)}, layout: "bld")
      end
    end

    test "mamba_decode_step names the conv operands" do
      ops = %{
        x: t({2, 8}, :f32),
        conv_state: t({2, 8, 3}, :f32),
        conv_weight: t({8, 4}, :f32),
        ssm_state: t({2, 8, 16}, :f32),
        dt: t({2, 8}, :f32),
        a: t({8, 16}, :f32),
        b: t({2, 1, 16}, :f32),
        c: t({2, 1, 16}, :f32)
      }

      call = Spec.mamba_decode_step(Map.put(ops, :conv_bias, t({8}, :f32)))
      assert names(call.operands) == ~w(x conv_state conv_weight ssm_state dt A B C conv_bias)
      assert names(call.results) == ~w(out conv_state ssm_state)

      assert_raise ArgumentError, ~r/operand `conv_weight` must have shape/, fn ->
        Spec.mamba_decode_step(%{ops | conv_weight: t({8, 7}, :f32)})
      end
    end
  end

  describe "workspace formulas (values from the Rust library's own unit tests and by hand)" do
    test "selective scan forward" do
      # 1 x 64 x 256 x 16: 4 chunks of 64 steps, records of 8 * 2 + 1 f32 per channel.
      assert Workspace.selective_scan_fwd_bytes(1, 64, 256, 16) == 3 * 64 * 17 * 4
      # ops/selective_scan: 1 x 4096 x 16384 splits in 8 chunks, 8 x 4096 x 2048 never.
      assert Workspace.selective_scan_fwd_bytes(1, 4096, 16_384, 16) == 7 * 4096 * 17 * 4
      assert Workspace.selective_scan_fwd_bytes(8, 4096, 2048, 16) == 0
      assert Workspace.selective_scan_fwd_bytes(1, 64, 127, 16) == 0
      assert Workspace.selective_scan_fwd_bytes(1, 64, 4096, 257) == 0
      assert Workspace.selective_scan_fwd_bytes(-1, 64, 4096, 16) == 0
    end

    test "selective scan backward" do
      # 1 x 4096 x 16384, dstate 16, one group: 4 parts (ops/selective_scan's test).
      rows = 4096
      bc = 64 * 16_384 * 16

      assert Workspace.selective_scan_bwd_bytes(1, 4096, 16_384, 16, 1) ==
               4 * (2 * bc + 4 * (rows * 16 + 2 * rows) + 3 * rows * 17)

      assert Workspace.selective_scan_bwd_bytes(1, 64, 100, 16, 3) == 0
    end

    test "SSD" do
      record = 64 * (64 * 128 + 1) * 4
      assert Workspace.ssd_fwd_bytes(1, 16_384, 64, 64, 128, 1, 256, {:bf, 16}) == 12 * record + 256
      assert Workspace.ssd_fwd_bytes(8, 2048, 64, 64, 128, 1, 256, {:bf, 16}) == 0
      # generic: delta 66 x 30 f32 (7920 -> 7936), A 840 -> 1024, D 256, dt_bias 256, + 256 slack
      assert Workspace.ssd_fwd_bytes(2, 33, 6, 5, 7, 3, 32, {:f, 32}) == 7936 + 1024 + 256 + 256 + 256
      assert Workspace.ssd_bwd_bytes(2, 33, 6, 5, 7, 4, 32, {:f, 32}) == 0
      assert Workspace.ssd_fwd_bytes(2, 100, 0, 16, 16, 1, 64, {:f, 32}) == 0

      assert Workspace.ssd_bwd_bytes(8, 2048, 64, 64, 128, 1, 256, {:bf, 16}) <
               Workspace.ssd_bwd_bytes(8, 2048, 256, 16, 128, 1, 256, {:bf, 16}) / 10

      # Heads of 128 and 192 as 64-wide split heads: dt, A, D and dt_bias per split head ahead of
      # the kernels' arrays (the C API's figures, tests/suite/ffi_cpu_ssd.rs).
      assert Workspace.ssd_fwd_bytes(8, 2048, 32, 128, 128, 1, 256, {:bf, 16}) ==
               8 * 2048 * 64 * 2 + 3 * 256 + 256

      assert Workspace.ssd_bwd_bytes(8, 2048, 32, 128, 128, 1, 256, {:bf, 16}) == 310_515_456
      assert Workspace.ssd_fwd_bytes(1, 16_384, 32, 128, 128, 1, 256, {:bf, 16}) == 27_267_072
      assert Workspace.ssd_fwd_bytes(2, 333, 3, 192, 64, 3, 64, {:bf, 16}) == 1_487_976
      assert Workspace.ssd_bwd_bytes(2, 333, 3, 192, 64, 3, 64, {:bf, 16}) == 3_831_296

      # Small dstates widened to the kernels' (plan::PadState), alone and with heads of 128.
      assert Workspace.ssd_fwd_bytes(8, 2048, 64, 64, 16, 1, 256, {:bf, 16}) == 54_526_208
      assert Workspace.ssd_bwd_bytes(8, 2048, 64, 64, 16, 1, 256, {:bf, 16}) == 482_480_384
      assert Workspace.ssd_fwd_bytes(3, 130, 3, 128, 32, 3, 64, {:bf, 16}) == 1_927_568
      assert Workspace.ssd_bwd_bytes(3, 130, 3, 128, 32, 3, 64, {:bf, 16}) == 3_735_552
      assert Workspace.ssd_bwd_bytes(1, 1087, 16, 64, 100, 4, 128, {:f, 16}) == 28_467_968

      # A state of 256 as two halves of 128 (plan::StateHalves): 128 heads' x, z and y, dt, A, D
      # and dt_bias, the initial and final states and the chunk states; no records (1024 blocks).
      per_step = 8 * 2048 * 128 * 64 * 2
      states = 8 * 128 * 64 * 128 * 4
      chunks = 8 * 128 * 64 * 8 * 128 * 2

      assert Workspace.ssd_fwd_bytes(8, 2048, 64, 64, 256, 1, 256, {:bf, 16}) ==
               3 * per_step + 8 * 2048 * 128 * 2 + 512 + 128 * 64 * 4 + 512 + 2 * states + chunks +
                 256
    end

    test "chunk_states type" do
      assert Workspace.ssd_chunk_states_type(64, 64, 64, {:bf, 16}) == {:bf, 16}
      assert Workspace.ssd_chunk_states_type(64, 128, 256, {:f, 16}) == {:f, 16}
      assert Workspace.ssd_chunk_states_type(64, 64, 32, {:bf, 16}) == {:f, 32}
      assert Workspace.ssd_chunk_states_type(48, 64, 64, {:bf, 16}) == {:bf, 16}
      assert Workspace.ssd_chunk_states_type(31, 64, 64, {:bf, 16}) == {:f, 32}
      assert Workspace.ssd_chunk_states_type(128, 128, 256, {:bf, 16}) == {:bf, 16}
      assert Workspace.ssd_chunk_states_type(96, 128, 256, {:bf, 16}) == {:bf, 16}
      assert Workspace.ssd_chunk_states_type(64, 16, 256, {:bf, 16}) == {:bf, 16}
      assert Workspace.ssd_chunk_states_type(64, 256, 256, {:bf, 16}) == {:bf, 16}
      assert Workspace.ssd_chunk_states_type(64, 200, 128, {:f, 16}) == {:f, 16}
      assert Workspace.ssd_chunk_states_type(64, 256, 32, {:bf, 16}) == {:f, 32}
      assert Workspace.ssd_chunk_states_type(64, 64, 64, {:f, 32}) == {:f, 32}
    end
  end
end
