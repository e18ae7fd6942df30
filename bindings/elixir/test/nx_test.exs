defmodule XlaSsm.NxTest do
  # Needs Nx (not EXLA): the public functions on Nx.BinaryBackend and under defn (the fallbacks,
  # custom gradients), checked against naive loops written here, and the Nx.block expressions
  # EXLA would lower, run through the same checks as the EXLA.CustomCall implementation.
  use ExUnit.Case, async: true

  alias XlaSsm.{Block, Reference, Spec}

  @moduletag timeout: 300_000

  ## data

  defp normal(seed, shape, scale \\ 0.5, type \\ {:f, 32}) do
    {t, _} = Nx.Random.normal(Nx.Random.key(seed), 0.0, scale, shape: shape)
    Nx.as_type(t, type)
  end

  defp uniform(seed, shape, lo, hi, type \\ {:f, 32}) do
    {t, _} = Nx.Random.uniform(Nx.Random.key(seed), lo, hi, shape: shape)
    Nx.as_type(t, type)
  end

  # Element access on a tensor's values (f64 floats), for the naive loops.
  defp vals(nil), do: nil
  defp vals(t), do: {t |> Nx.as_type({:f, 64}) |> Nx.to_flat_list() |> List.to_tuple(), Nx.shape(t)}

  defp at({flat, shape}, idx) do
    dims = Tuple.to_list(shape)

    offset =
      Enum.zip(idx, dims)
      |> Enum.reduce(0, fn {i, n}, acc -> acc * n + i end)

    elem(flat, offset)
  end

  defp softplus(x), do: if(x > 20, do: x, else: :math.log(1 + :math.exp(x)))
  defp silu(x), do: x / (1 + :math.exp(-x))

  defp assert_close(got, want, tol \\ 1.0e-4) do
    got = got |> Nx.as_type({:f, 64}) |> Nx.to_flat_list()
    want = List.flatten(want)
    assert length(got) == length(want)
    worst = Enum.zip(got, want) |> Enum.map(fn {g, w} -> abs(g - w) / (1 + abs(w)) end) |> Enum.max()
    assert worst < tol, "worst relative error #{worst}"
  end

  ## naive references (plain Elixir floats)

  # Selective scan, layout "bdl" indices; returns {out [b][d][l], final [b][d][n], states entering
  # each step [b][d][l][n]}.
  defp naive_scan(ops, softplus?) do
    {batch, dim, seqlen} = Nx.shape(ops.u)
    dstate = Nx.axis_size(ops.a, 1)

    [u, delta, a, b, c, d, z, bias, h0] =
      Enum.map([:u, :delta, :a, :b, :c, :d, :z, :delta_bias, :initial_state], &vals(ops[&1]))

    tv = Nx.rank(ops.b) == 4
    groups = if tv, do: Nx.axis_size(ops.b, 1), else: dim

    bc = fn m, bi, di, n, l -> if tv, do: at(m, [bi, div(di, div(dim, groups)), n, l]), else: at(m, [di, n]) end

    rows =
      for bi <- 0..(batch - 1), di <- 0..(dim - 1) do
        h = for n <- 0..(dstate - 1), do: if(h0, do: at(h0, [bi, di, n]), else: 0.0)

        {ys, h, entering} =
          Enum.reduce(0..(seqlen - 1), {[], h, []}, fn l, {ys, h, entering} ->
            dt = at(delta, [bi, di, l]) + if(bias, do: at(bias, [di]), else: 0.0)
            dt = if softplus?, do: softplus(dt), else: dt
            x = at(u, [bi, di, l])

            new_h =
              for n <- 0..(dstate - 1),
                  do: :math.exp(dt * at(a, [di, n])) * Enum.at(h, n) + dt * bc.(b, bi, di, n, l) * x

            y = Enum.sum(for n <- 0..(dstate - 1), do: bc.(c, bi, di, n, l) * Enum.at(new_h, n))
            y = y + if(d, do: at(d, [di]) * x, else: 0.0)
            y = if z, do: y * silu(at(z, [bi, di, l])), else: y
            {[y | ys], new_h, [h | entering]}
          end)

        {Enum.reverse(ys), h, Enum.reverse(entering)}
      end

    group = fn list -> Enum.chunk_every(list, dim) end
    {group.(Enum.map(rows, &elem(&1, 0))), group.(Enum.map(rows, &elem(&1, 1))), group.(Enum.map(rows, &elem(&1, 2)))}
  end

  defp scan_ops(seed, batch, dim, seqlen, dstate, groups) do
    %{
      u: normal(seed, {batch, dim, seqlen}),
      delta: uniform(seed + 1, {batch, dim, seqlen}, 0.01, 0.5),
      a: uniform(seed + 2, {dim, dstate}, -2.0, -0.5),
      b: normal(seed + 3, {batch, groups, dstate, seqlen}),
      c: normal(seed + 4, {batch, groups, dstate, seqlen})
    }
  end

  defp all_optional(ops, seed) do
    {batch, dim, seqlen} = Nx.shape(ops.u)
    dstate = Nx.axis_size(ops.a, 1)

    Map.merge(ops, %{
      d: normal(seed, {dim}),
      z: normal(seed + 1, {batch, dim, seqlen}),
      delta_bias: uniform(seed + 2, {dim}, 0.0, 0.3),
      initial_state: normal(seed + 3, {batch, dim, dstate})
    })
  end

  defp bld(t), do: Nx.transpose(t, axes: [0, 2, 1])

  ## selective scan

  describe "selective_scan (fallback)" do
    test "matches a naive loop: groups, every optional operand, softplus, both layouts" do
      ops = scan_ops(1, 2, 4, 9, 3, 2) |> all_optional(10)
      {want_out, want_h, _} = naive_scan(ops, true)

      args = [
        d: ops.d,
        z: ops.z,
        delta_bias: ops.delta_bias,
        initial_state: ops.initial_state,
        delta_softplus: true,
        return_final_state: true
      ]

      {out, h} = XlaSsm.selective_scan(ops.u, ops.delta, ops.a, ops.b, ops.c, args)
      assert_close(out, want_out)
      assert_close(h, want_h)

      # Channel-last: the same numbers, transposed inputs and output.
      tv = fn t -> Nx.transpose(t, axes: [0, 3, 1, 2]) end

      {out_l, h_l} =
        XlaSsm.selective_scan(bld(ops.u), bld(ops.delta), ops.a, tv.(ops.b), tv.(ops.c), [
          {:layout, "bld"} | Keyword.put(args, :z, bld(ops.z))
        ])

      assert_close(bld(out_l), want_out)
      assert_close(h_l, want_h)
    end

    test "time-invariant B/C, bf16 inputs with f32 B/C" do
      ops = %{scan_ops(2, 1, 3, 7, 4, 1) | b: normal(30, {3, 4}), c: normal(31, {3, 4})}
      rounded = %{ops | u: Nx.as_type(ops.u, {:bf, 16}), delta: Nx.as_type(ops.delta, {:bf, 16})}
      out = XlaSsm.selective_scan(rounded.u, rounded.delta, ops.a, ops.b, ops.c)
      assert out.type == {:bf, 16}
      {want_out, _, _} = naive_scan(rounded, false)
      assert_close(out, want_out, 1.0e-2)
    end

    test "the forward with checkpoints keeps the state entering every checkpoint_len-th step" do
      ops = scan_ops(3, 1, 2, 70, 2, 1)
      {_, _, entering} = naive_scan(ops, false)
      {_out, _h, checkpoints} = Reference.selective_scan_fwd(ops, checkpoint_len: 32, workspace: false)
      assert Nx.shape(checkpoints) == {1, 2, 3, 2}
      want = for row <- entering, do: for(channel <- row, do: Enum.map([0, 32, 64], &Enum.at(channel, &1)))
      assert_close(checkpoints, want)
    end

    test "gradients (custom_grad -> the backward target's fallback) match finite differences" do
      ops = scan_ops(4, 1, 4, 6, 2, 2) |> all_optional(40)
      w = normal(50, {1, 4, 6})
      v = normal(51, {1, 4, 2})

      loss = fn t ->
        {out, h} =
          XlaSsm.selective_scan(t.u, t.delta, t.a, t.b, t.c,
            d: t.d,
            z: t.z,
            delta_bias: t.delta_bias,
            initial_state: t.initial_state,
            delta_softplus: true,
            return_final_state: true
          )

        Nx.add(Nx.sum(Nx.multiply(out, w)), Nx.sum(Nx.multiply(h, v)))
      end

      entries = [
        u: [0, 1, 3],
        u: [0, 3, 5],
        delta: [0, 2, 4],
        a: [2, 1],
        b: [0, 1, 1, 2],
        c: [0, 0, 1, 5],
        d: [3],
        z: [0, 2, 1],
        delta_bias: [0],
        initial_state: [0, 3, 1]
      ]

      check_finite_differences(loss, ops, entries)

      # Time-invariant B/C, channel-last, the final state unused: its cotangent is dropped.
      ti = %{u: bld(ops.u), delta: bld(ops.delta), a: ops.a, b: normal(52, {4, 2}), c: normal(53, {4, 2})}

      loss_ti = fn t ->
        Nx.sum(Nx.multiply(XlaSsm.selective_scan(t.u, t.delta, t.a, t.b, t.c, layout: "bld"), bld(w)))
      end

      check_finite_differences(loss_ti, ti, u: [0, 3, 1], delta: [0, 5, 2], a: [1, 0], b: [2, 1], c: [3, 0])
    end
  end

  describe "selective_scan with packed sequences (fallback)" do
    # Sequences of 3, 0, 4 and 2 steps (an empty one) along seqlen 9 of one batch row.
    @cu [0, 3, 3, 7, 9]

    defp packed_ops(seed) do
      ops = scan_ops(seed, 1, 4, 9, 3, 2) |> all_optional(seed + 10)
      num_seqs = length(@cu) - 1
      %{ops | initial_state: normal(seed + 20, {num_seqs, 4, 3})}
    end

    # One unpacked call per sequence on its steps (time-varying B/C sliced alike), outputs
    # concatenated along seqlen: what a packed call must equal (the JAX binding's _packed_ref).
    defp per_sequence(ops, cu, opts) do
      dstate = Nx.axis_size(ops.a, 1)
      dim = Nx.axis_size(ops.a, 0)

      pieces =
        for {{lo, hi}, s} <- Enum.with_index(Enum.zip(cu, tl(cu))) do
          h0 = Nx.slice(ops.initial_state, [s, 0, 0], [1, dim, dstate])

          if hi == lo do
            {nil, h0}
          else
            cut = fn t, axis -> Nx.slice_along_axis(t, lo, hi - lo, axis: axis) end

            {out, h} =
              XlaSsm.selective_scan(
                cut.(ops.u, 2),
                cut.(ops.delta, 2),
                ops.a,
                cut.(ops.b, 3),
                cut.(ops.c, 3),
                Keyword.merge(opts,
                  d: ops.d,
                  z: cut.(ops.z, 2),
                  delta_bias: ops.delta_bias,
                  initial_state: h0,
                  return_final_state: true
                )
              )

            {out, h}
          end
        end

      outs = for {out, _} <- pieces, out != nil, do: out
      {Nx.concatenate(outs, axis: 2), Nx.concatenate(Enum.map(pieces, &elem(&1, 1)), axis: 0)}
    end

    test "equals one call per sequence (an empty one keeps its initial state), both layouts" do
      ops = packed_ops(60)
      cu = Nx.tensor(@cu, type: :s32)
      {want_out, want_h} = per_sequence(ops, @cu, delta_softplus: true)

      args = [
        d: ops.d,
        z: ops.z,
        delta_bias: ops.delta_bias,
        initial_state: ops.initial_state,
        cu_seqlens: cu,
        delta_softplus: true,
        return_final_state: true
      ]

      {out, h} = XlaSsm.selective_scan(ops.u, ops.delta, ops.a, ops.b, ops.c, args)
      assert Nx.shape(h) == {4, 4, 3}
      assert_close(out, Nx.to_list(want_out))
      assert_close(h, Nx.to_list(want_h))
      # The empty sequence's final state is its initial state.
      assert_close(h[1], Nx.to_list(ops.initial_state[1]), 1.0e-6)

      tv = fn t -> Nx.transpose(t, axes: [0, 3, 1, 2]) end

      {out_l, h_l} =
        XlaSsm.selective_scan(bld(ops.u), bld(ops.delta), ops.a, tv.(ops.b), tv.(ops.c), [
          {:layout, "bld"} | Keyword.merge(args, z: bld(ops.z), cu_seqlens: Nx.tensor(@cu, type: :s64))
        ])

      assert_close(bld(out_l), Nx.to_list(want_out))
      assert_close(h_l, Nx.to_list(want_h))

      # Without initial states every sequence starts from zero.
      no_h0 = Keyword.delete(args, :initial_state)
      {_, h0_free} = XlaSsm.selective_scan(ops.u, ops.delta, ops.a, ops.b, ops.c, no_h0)
      {_, want_free} = per_sequence(%{ops | initial_state: Nx.broadcast(0.0, {4, 4, 3})}, @cu, delta_softplus: true)
      assert_close(h0_free, Nx.to_list(want_free))
    end

    test "checkpoints hold the state entering their step before the boundary rule" do
      ops = scan_ops(70, 1, 2, 70, 2, 1)
      # A boundary on checkpoint 1 (step 32); checkpoint 2 (step 64) inside the last sequence.
      cu = [0, 32, 32, 50, 70]
      tensor = Nx.tensor(cu, type: :s32)
      {_out, h, checkpoints} = Reference.selective_scan_fwd(Map.put(ops, :cu_seqlens, tensor), checkpoint_len: 32)
      assert Nx.shape(checkpoints) == {1, 2, 3, 2}

      naive = fn lo, hi ->
        piece = fn t, axis -> Nx.slice_along_axis(t, lo, hi - lo, axis: axis) end

        naive_scan(
          %{ops | u: piece.(ops.u, 2), delta: piece.(ops.delta, 2), b: piece.(ops.b, 3), c: piece.(ops.c, 3)},
          false
        )
      end

      {_, final0, _} = naive.(0, 32)
      {_, final3, entering3} = naive.(50, 70)
      zeros = [[0.0, 0.0], [0.0, 0.0]]
      # [channel][checkpoint][state]: 0 before anything, seq 0's final state, step 64 of seq 3.
      want =
        for ch <- 0..1 do
          [Enum.at(zeros, ch), Enum.at(hd(final0), ch), Enum.at(Enum.at(hd(entering3), ch), 64 - 50)]
        end

      assert_close(checkpoints, [want])
      # Sequences 1 (empty) and 2 start from zero: final state 0 and seq 2's own.
      assert_close(h[1], zeros, 1.0e-6)
      assert_close(h[3], hd(final3))
    end

    test "gradients through the packed backward match finite differences" do
      ops = packed_ops(80)
      cu = Nx.tensor(@cu, type: :s32)
      w = normal(90, {1, 4, 9})
      v = normal(91, {4, 4, 3})

      loss = fn t ->
        {out, h} =
          XlaSsm.selective_scan(t.u, t.delta, t.a, t.b, t.c,
            d: t.d,
            z: t.z,
            delta_bias: t.delta_bias,
            initial_state: t.initial_state,
            cu_seqlens: cu,
            delta_softplus: true,
            return_final_state: true
          )

        Nx.add(Nx.sum(Nx.multiply(out, w)), Nx.sum(Nx.multiply(h, v)))
      end

      # Steps on both sides of boundaries, each sequence's initial state (the empty one's too).
      entries = [
        u: [0, 1, 2],
        u: [0, 3, 3],
        u: [0, 0, 8],
        delta: [0, 2, 6],
        delta: [0, 1, 7],
        a: [2, 1],
        b: [0, 1, 1, 3],
        c: [0, 0, 2, 7],
        d: [3],
        z: [0, 2, 5],
        delta_bias: [1],
        initial_state: [0, 3, 1],
        initial_state: [1, 2, 0],
        initial_state: [2, 0, 2],
        initial_state: [3, 1, 1]
      ]

      check_finite_differences(loss, ops, entries)
    end

    test "concrete bad boundaries and non-integer ones raise" do
      ops = packed_ops(100)

      for bad <- [[1, 3, 3, 7, 9], [0, 3, 2, 7, 9], [0, 3, 3, 7, 8], [0, 3, 3, 7, 10]] do
        assert_raise ArgumentError, ~r/cu_seqlens must start at 0, never decrease and end at seqlen \(= 9\)/, fn ->
          XlaSsm.selective_scan(ops.u, ops.delta, ops.a, ops.b, ops.c, cu_seqlens: Nx.tensor(bad))
        end
      end

      assert_raise ArgumentError, ~r/cu_seqlens must be integers/, fn ->
        XlaSsm.selective_scan(ops.u, ops.delta, ops.a, ops.b, ops.c, cu_seqlens: Nx.tensor([0.0, 9.0]))
      end

      # Shapes are XlaSsm.Spec's: initial states per sequence.
      assert_raise ArgumentError, ~r/operand `initial_state` must have shape \{4, 4, 3\}/, fn ->
        XlaSsm.selective_scan(ops.u, ops.delta, ops.a, ops.b, ops.c,
          cu_seqlens: Nx.tensor(@cu),
          initial_state: normal(1, {1, 4, 3})
        )
      end
    end
  end

  # d loss / d ops[key][index] by the custom gradient against central differences.
  defp check_finite_differences(loss, ops, entries, eps \\ 1.0e-2) do
    got = Nx.Defn.jit(fn t -> Nx.Defn.grad(t, loss) end).(ops)
    value = Nx.Defn.jit(loss)

    for {key, index} <- entries do
      bump = fn sign -> Map.update!(ops, key, &Nx.indexed_add(&1, Nx.tensor([index]), Nx.tensor([sign * eps]))) end
      fd = (Nx.to_number(value.(bump.(1.0))) - Nx.to_number(value.(bump.(-1.0)))) / (2 * eps)
      grad = Nx.to_number(got[key][index])

      assert_in_delta grad,
                      fd,
                      1.0e-2 * (1 + abs(fd)),
                      "d/d#{key}#{inspect(index)}: #{grad} vs finite differences #{fd}"
    end
  end

  ## SSD

  defp naive_ssd(ops, softplus?, {lo, hi}, chunk) do
    {batch, seqlen, heads, headdim} = Nx.shape(ops.x)
    {_, _, groups, dstate} = Nx.shape(ops.b)

    [x, dt, a, b, c, d, z, bias, h0] =
      Enum.map([:x, :dt, :a, :b, :c, :d, :z, :dt_bias, :initial_states], &vals(ops[&1]))

    d_rank = if ops[:d], do: Nx.rank(ops.d), else: 0

    clamp = fn v ->
      v |> then(&if(is_number(lo), do: max(&1, lo), else: &1)) |> then(&if(is_number(hi), do: min(&1, hi), else: &1))
    end

    per_head =
      for bi <- 0..(batch - 1), hh <- 0..(heads - 1) do
        g = div(hh, div(heads, groups))
        s0 = for p <- 0..(headdim - 1), do: for(n <- 0..(dstate - 1), do: if(h0, do: at(h0, [bi, hh, p, n]), else: 0.0))

        Enum.reduce(0..(seqlen - 1), {[], s0, []}, fn t, {ys, s, entering} ->
          v = at(dt, [bi, t, hh]) + if(bias, do: at(bias, [hh]), else: 0.0)
          v = clamp.(if softplus?, do: softplus(v), else: v)
          decay = :math.exp(v * at(a, [hh]))
          entering = if rem(t, chunk) == 0, do: [s | entering], else: entering

          new_s =
            for p <- 0..(headdim - 1),
                do:
                  for(
                    n <- 0..(dstate - 1),
                    do: decay * Enum.at(Enum.at(s, p), n) + v * at(x, [bi, t, hh, p]) * at(b, [bi, t, g, n])
                  )

          y =
            for p <- 0..(headdim - 1) do
              yp = Enum.sum(for n <- 0..(dstate - 1), do: Enum.at(Enum.at(new_s, p), n) * at(c, [bi, t, g, n]))

              dd =
                case d_rank do
                  0 -> 0.0
                  1 -> at(d, [hh])
                  2 -> at(d, [hh, p])
                end

              yp = yp + dd * at(x, [bi, t, hh, p])
              if z, do: yp * silu(at(z, [bi, t, hh, p])), else: yp
            end

          {[y | ys], new_s, entering}
        end)
      end

    ys = Enum.map(per_head, fn {ys, _, _} -> Enum.reverse(ys) end)
    # y as [b][t][h][p]
    y =
      for bi <- 0..(batch - 1),
          do: for(t <- 0..(seqlen - 1), do: for(hh <- 0..(heads - 1), do: Enum.at(Enum.at(ys, bi * heads + hh), t)))

    finals = Enum.map(per_head, fn {_, s, _} -> s end)
    chunks = Enum.map(per_head, fn {_, _, e} -> Enum.reverse(e) end)
    {y, finals, chunks}
  end

  describe "ssd (fallback)" do
    test "matches a naive recurrence: groups, D per channel, z, dt_bias, clamp, initial states, chunk_states" do
      {batch, seqlen, heads, headdim, dstate, groups} = {1, 40, 4, 3, 2, 2}

      ops = %{
        x: normal(60, {batch, seqlen, heads, headdim}),
        dt: uniform(61, {batch, seqlen, heads}, 0.01, 0.5),
        a: uniform(62, {heads}, -2.0, -0.5),
        b: normal(63, {batch, seqlen, groups, dstate}),
        c: normal(64, {batch, seqlen, groups, dstate}),
        d: normal(65, {heads, headdim}),
        z: normal(66, {batch, seqlen, heads, headdim}),
        dt_bias: uniform(67, {heads}, 0.0, 0.3),
        initial_states: normal(68, {batch, heads, headdim, dstate})
      }

      limit = {0.05, 0.6}
      {want_y, want_final, want_chunks} = naive_ssd(ops, true, limit, 32)

      {y, final} =
        XlaSsm.ssd(ops.x, ops.dt, ops.a, ops.b, ops.c,
          chunk_size: 32,
          d: ops.d,
          z: ops.z,
          dt_bias: ops.dt_bias,
          initial_states: ops.initial_states,
          dt_softplus: true,
          dt_limit: limit,
          return_final_states: true
        )

      assert_close(y, want_y)
      assert_close(final, want_final)

      {_, _, chunk_states} =
        Reference.ssd_fwd(ops,
          chunk_size: 32,
          dt_softplus: true,
          dt_limit: limit,
          save_chunk_states: true,
          workspace: false
        )

      assert Nx.shape(chunk_states) == {1, 4, 3, 2, 2}
      # naive: [b*h][chunk][p][n] -> (b, h, p, chunk, n)
      want = for hh <- want_chunks, do: for(p <- 0..2, do: for(k <- 0..1, do: Enum.at(Enum.at(hh, k), p)))
      assert_close(chunk_states, want)
    end

    test "the default dt_limit does not clamp; gradients match finite differences" do
      ops = %{
        x: normal(70, {1, 5, 2, 2}),
        dt: uniform(71, {1, 5, 2}, -0.3, 0.5),
        a: uniform(72, {2}, -2.0, -0.5),
        b: normal(73, {1, 5, 1, 3}),
        c: normal(74, {1, 5, 1, 3}),
        d: normal(75, {2})
      }

      {want_y, _, _} = naive_ssd(ops, true, {:neg_infinity, :infinity}, 256)
      assert_close(XlaSsm.ssd(ops.x, ops.dt, ops.a, ops.b, ops.c, d: ops.d, dt_softplus: true), want_y)

      w = normal(76, {1, 5, 2, 2})

      loss = fn t ->
        Nx.sum(Nx.multiply(XlaSsm.ssd(t.x, t.dt, t.a, t.b, t.c, d: t.d, dt_softplus: true, chunk_size: 32), w))
      end

      check_finite_differences(loss, ops,
        x: [0, 2, 1, 0],
        dt: [0, 3, 1],
        a: [1],
        b: [0, 2, 0, 1],
        c: [0, 4, 0, 2],
        d: [1]
      )

      # With a clamp, per-channel D, z, dt_bias, initial and final states (2 groups).
      full =
        Map.merge(%{ops | b: normal(77, {1, 5, 2, 3}), c: normal(78, {1, 5, 2, 3}), d: normal(79, {2, 2})}, %{
          z: normal(80, {1, 5, 2, 2}),
          dt_bias: uniform(81, {2}, 0.0, 0.3),
          initial_states: normal(82, {1, 2, 2, 3})
        })

      v = normal(83, {1, 2, 2, 3})

      loss_full = fn t ->
        {y, h} =
          XlaSsm.ssd(t.x, t.dt, t.a, t.b, t.c,
            d: t.d,
            z: t.z,
            dt_bias: t.dt_bias,
            initial_states: t.initial_states,
            dt_softplus: true,
            dt_limit: {0.0, 0.7},
            return_final_states: true,
            chunk_size: 32
          )

        Nx.add(Nx.sum(Nx.multiply(y, w)), Nx.sum(Nx.multiply(h, v)))
      end

      check_finite_differences(loss_full, full,
        x: [0, 1, 1, 1],
        dt: [0, 2, 0],
        a: [0],
        b: [0, 3, 1, 2],
        c: [0, 1, 0, 0],
        d: [1, 0],
        z: [0, 4, 1, 1],
        dt_bias: [1],
        initial_states: [0, 1, 0, 2]
      )
    end
  end

  ## decode

  describe "decode (fallback)" do
    test "selective_state_update with a pool and a padding row" do
      {slots, batch, dim, dstate} = {4, 3, 4, 2}
      state = normal(80, {slots, dim, dstate})
      x = normal(81, {batch, dim})
      dt = uniform(82, {batch, dim}, 0.01, 0.5)
      a = uniform(83, {dim, dstate}, -2.0, -0.5)
      b = normal(84, {batch, 2, dstate})
      c = normal(85, {batch, 2, dstate})
      d = normal(86, {dim})
      ix = Nx.tensor([2, 0, -1], type: {:s, 32})
      {out, new_state} = XlaSsm.selective_state_update(state, x, dt, a, b, c, d: d, state_batch_indices: ix)
      [sv, xv, dtv, av, bv, cv, dv] = Enum.map([state, x, dt, a, b, c, d], &vals/1)

      rows =
        for {slot, i} <- [{2, 0}, {0, 1}] do
          for di <- 0..(dim - 1) do
            g = div(di, 2)

            h =
              for n <- 0..(dstate - 1),
                  do:
                    :math.exp(at(dtv, [i, di]) * at(av, [di, n])) * at(sv, [slot, di, n]) +
                      at(dtv, [i, di]) * at(bv, [i, g, n]) * at(xv, [i, di])

            y =
              Enum.sum(for n <- 0..(dstate - 1), do: Enum.at(h, n) * at(cv, [i, g, n])) + at(dv, [di]) * at(xv, [i, di])

            {y, h}
          end
        end

      want_out = Enum.map(rows, fn r -> Enum.map(r, &elem(&1, 0)) end) ++ [List.duplicate(0.0, dim)]
      assert_close(out, want_out)
      untouched = Nx.to_flat_list(state[1]) ++ Nx.to_flat_list(state[3])
      [r2, r0] = Enum.map(rows, fn r -> Enum.map(r, &elem(&1, 1)) end)

      assert_close(new_state, [
        r0,
        Enum.chunk_every(Enum.slice(untouched, 0, 8), 2),
        r2,
        Enum.chunk_every(Enum.slice(untouched, 8, 8), 2)
      ])
    end

    test "causal_conv1d: naive taps, silu, bias, initial states, final states, channel-last; gradient" do
      x = normal(90, {2, 3, 6})
      w = normal(91, {3, 4})
      bias = normal(92, {3})
      h0 = normal(93, {2, 3, 3})
      [xv, wv, bv, hv] = Enum.map([x, w, bias, h0], &vals/1)
      pad = fn bi, di, t -> if t < 0, do: at(hv, [bi, di, t + 3]), else: at(xv, [bi, di, t]) end

      want =
        for bi <- 0..1,
            do:
              for(
                di <- 0..2,
                do:
                  for(
                    t <- 0..5,
                    do: silu(at(bv, [di]) + Enum.sum(for k <- 0..3, do: at(wv, [di, k]) * pad.(bi, di, t - 3 + k)))
                  )
              )

      {out, final} =
        XlaSsm.causal_conv1d(x, w, bias: bias, initial_states: h0, activation: :silu, return_final_states: true)

      assert_close(out, want)
      assert Nx.to_flat_list(final) == Nx.to_flat_list(x[[.., .., 3..5]])
      out_l = XlaSsm.causal_conv1d(bld(x), w, bias: bias, initial_states: h0, activation: :silu, layout: "bld")
      assert_close(bld(out_l), want)

      g = normal(94, {2, 3, 6})

      through_blocks = fn {x, w, b, h} ->
        Nx.sum(Nx.multiply(XlaSsm.causal_conv1d(x, w, bias: b, initial_states: h, activation: :silu), g))
      end

      plain = fn {x, w, b, h} ->
        Nx.sum(
          Nx.multiply(
            Reference.causal_conv1d_fwd(%{x: x, weight: w, bias: b, initial_states: h}, silu: true, layout: "bdl"),
            g
          )
        )
      end

      got = Nx.Defn.jit(fn t -> Nx.Defn.grad(t, through_blocks) end).({x, w, bias, h0})
      want_g = Nx.Defn.jit(fn t -> Nx.Defn.grad(t, plain) end).({x, w, bias, h0})
      for i <- 0..3, do: assert_close(elem(got, i), Nx.to_flat_list(elem(want_g, i)))
    end

    test "causal_conv1d_update continues causal_conv1d" do
      x = normal(100, {2, 3, 7})
      w = normal(101, {3, 3})
      full = XlaSsm.causal_conv1d(x, w)
      {_, state} = XlaSsm.causal_conv1d(x[[.., .., 0..4]], w, return_final_states: true)
      {out, new_state} = XlaSsm.causal_conv1d_update(x[[.., .., 5..6]], state, w)
      assert_close(out, Nx.to_flat_list(full[[.., .., 5..6]]))
      assert_close(new_state, Nx.to_flat_list(x[[.., .., 5..6]]))
      {one, _} = XlaSsm.causal_conv1d_update(x[[.., .., 5]], state, w)
      assert_close(one, Nx.to_flat_list(full[[.., .., 5]]))
    end

    test "mamba_decode_step = conv update + silu + state update" do
      x = normal(110, {2, 4})
      conv_state = normal(111, {2, 4, 3})
      conv_w = normal(112, {4, 4})
      ssm_state = normal(113, {2, 4, 2})
      dt = uniform(114, {2, 4}, 0.01, 0.5)
      a = uniform(115, {4, 2}, -2.0, -0.5)
      b = normal(116, {2, 1, 2})
      c = normal(117, {2, 1, 2})
      {out, cs, ss} = XlaSsm.mamba_decode_step(x, conv_state, conv_w, ssm_state, dt, a, b, c, dt_softplus: true)
      {xc, cs2} = XlaSsm.causal_conv1d_update(x, conv_state, conv_w, activation: :silu)
      {out2, ss2} = XlaSsm.selective_state_update(ssm_state, xc, dt, a, b, c, dt_softplus: true)
      assert_close(out, Nx.to_flat_list(out2), 1.0e-6)
      assert_close(cs, Nx.to_flat_list(cs2), 1.0e-6)
      assert_close(ss, Nx.to_flat_list(ss2), 1.0e-6)
    end
  end

  ## what EXLA would see

  # The :block expressions of a traced function, as EXLA's defn compiler visits them.
  defp blocks(fun, args) do
    expr = apply(Nx.Defn.debug_expr(fun), args)
    {found, _} = walk(expr, {[], MapSet.new()})
    Enum.reverse(found)
  end

  defp walk(%Nx.Tensor{data: %Nx.Defn.Expr{id: id, op: op, args: args}}, {found, seen} = acc) do
    if MapSet.member?(seen, id) do
      acc
    else
      acc = {if(op == :block, do: [args | found], else: found), MapSet.put(seen, id)}
      Enum.reduce(args, acc, &walk/2)
    end
  end

  defp walk(list, acc) when is_list(list), do: Enum.reduce(list, acc, &walk/2)
  defp walk(tuple, acc) when is_tuple(tuple), do: walk(Tuple.to_list(tuple), acc)
  defp walk(_other, acc), do: acc

  test "inside defn each function is one block whose tag, arguments and output make the fixture's call" do
    ops = scan_ops(120, 2, 8, 64, 16, 1) |> Map.put(:d, normal(121, {8}))

    [[tag, in_args, out, _fun]] =
      blocks(fn u, delta, a, b, c, d -> XlaSsm.selective_scan(u, delta, a, b, c, d: d, delta_softplus: true) end, [
        ops.u,
        ops.delta,
        ops.a,
        ops.b,
        ops.c,
        ops.d
      ])

    assert %Block.SelectiveScanFwd{operands: [:u, :delta, :a, :b, :c, :d]} = tag
    # What the EXLA.CustomCall implementation does with them (lib/xla_ssm/exla.ex).
    call = Block.spec(tag, in_args)
    assert :ok = Block.check_output!(call, out)
    assert call.target == "xla_ssm_selective_scan_fwd"
    assert {"has_d", "true"} in call.attributes and {"delta_softplus", "true"} in call.attributes
    assert call == Spec.selective_scan_fwd(Map.take(ops, [:u, :delta, :a, :b, :c, :d]), delta_softplus: true)

    # A gradient adds the forward with checkpoints and the backward.
    grad_blocks =
      blocks(
        fn u, delta, a, b, c -> Nx.Defn.grad(u, fn u -> Nx.sum(XlaSsm.selective_scan(u, delta, a, b, c)) end) end,
        [ops.u, ops.delta, ops.a, ops.b, ops.c]
      )

    targets =
      for [tag, in_args, out, _] <- grad_blocks, uniq: true do
        call = Block.spec(tag, in_args)
        assert :ok = Block.check_output!(call, out)
        {call.target, List.keyfind(call.attributes, "checkpoint_len", 0)}
      end

    assert {"xla_ssm_selective_scan_bwd", {"checkpoint_len", "32 : i64"}} in targets
    assert {"xla_ssm_selective_scan_fwd", {"checkpoint_len", "32 : i64"}} in targets

    # Packed: cu_seqlens is the forward's last operand and goes to the backward as well.
    packed = scan_ops(122, 1, 8, 64, 16, 1)
    cu = Nx.tensor([0, 10, 64], type: :s32)

    packed_blocks =
      blocks(
        fn u, delta, a, b, c, cu ->
          Nx.Defn.grad(u, fn u -> Nx.sum(XlaSsm.selective_scan(u, delta, a, b, c, cu_seqlens: cu)) end)
        end,
        [packed.u, packed.delta, packed.a, packed.b, packed.c, cu]
      )

    packed_calls =
      for [tag, in_args, out, _] <- packed_blocks do
        call = Block.spec(tag, in_args)
        assert :ok = Block.check_output!(call, out)
        assert {"has_cu_seqlens", "true"} in call.attributes
        assert {"final_state", {2, 8, 16}, {:f, 32}} in call.results or call.target =~ "bwd"
        {call.target, Enum.map(call.operands, &elem(&1, 0))}
      end

    assert {"xla_ssm_selective_scan_bwd", ~w(u delta A B C cu_seqlens checkpoints dout)} in packed_calls
    assert {"xla_ssm_selective_scan_fwd", ~w(u delta A B C cu_seqlens)} in packed_calls
  end

  test "the EXLA.CustomCall implementation (against a stand-in of EXLA's protocol where EXLA is absent)" do
    unless Code.ensure_loaded?(EXLA.CustomCall) do
      # The protocol and spec struct as EXLA 0.12-0.13 define them (exla/lib/exla/custom_call*.ex).
      Code.compile_string("""
      defprotocol EXLA.CustomCall do
        @fallback_to_any true
        def call(struct, out, args, client)
      end

      defmodule EXLA.CustomCall.Spec do
        @enforce_keys [:call_target_name]
        defstruct [:call_target_name, attributes: [], operand_element_types: :default]
      end
      """)

      Code.compile_file(Path.expand("../lib/xla_ssm/exla.ex", __DIR__))
    end

    x = normal(130, {1, 40, 2, 4})

    args = [
      x,
      uniform(131, {1, 40, 2}, 0.0, 0.5),
      uniform(132, {2}, -2.0, -0.5),
      normal(133, {1, 40, 1, 4}),
      normal(134, {1, 40, 1, 4})
    ]

    [[tag, in_args, out, _]] =
      blocks(fn x, dt, a, b, c -> XlaSsm.ssd(x, dt, a, b, c, chunk_size: 32, dt_limit: {0.0, 1.5}) end, args)

    # apply/3: the protocol may not exist when this file is compiled.
    exla_call = fn out, platform -> apply(EXLA.CustomCall, :call, [tag, out, in_args, %{platform: platform}]) end

    for platform <- [:host, :cuda] do
      assert {:ok, spec} = exla_call.(out, platform)
      assert spec.__struct__ == EXLA.CustomCall.Spec
      assert spec.call_target_name == "xla_ssm_ssd_fwd"
      assert {"dt_max", "1.5 : f32"} in spec.attributes and {"chunk_size", "32 : i64"} in spec.attributes
    end

    for platform <- [:rocm, :tpu, :pjrt_plugin], do: assert(exla_call.(out, platform) == :skip)
    # An output that is not the target's results is a bug between the fallback and the spec.
    assert_raise ArgumentError, ~r/is not the target's results/, fn -> exla_call.(elem(out, 0), :host) end
  end

  test "every fixture call's fallback returns exactly the call's results (traced, as inside defn)" do
    for {id, call} <- XlaSsm.Test.Fixture.calls() do
      args = Enum.map(call.operands, fn {_, shape, type} -> Nx.template(shape, type) end)
      tag_module = Enum.find(Block.tags(), &("xla_ssm_#{Block.function(&1)}" == call.target))
      keys = Enum.map(call.operands, fn {name, _, _} -> key_of(name) end)
      tag = struct!(tag_module, operands: keys, opts: opts_of(call))
      assert Block.spec(tag, args) == call, id
      # The block's output types inside defn are the traced fallback's.
      result = Nx.Defn.debug_expr(fn args -> Block.fallback(tag, Tuple.to_list(args)) end).(List.to_tuple(args))
      leaves = if is_tuple(result), do: Tuple.to_list(result), else: [result]
      assert Enum.map(leaves, &{&1.shape, &1.type}) == Enum.map(call.results, fn {_, s, t} -> {s, t} end), id
      assert :ok = Block.check_output!(call, result)
    end
  end

  defp key_of(name), do: name |> String.downcase() |> String.to_atom()

  # The XlaSsm.Spec options a fixture call was made with, read back from its attributes.
  defp opts_of(%Spec.Call{target: target, attributes: attrs, results: results}) do
    value = fn name ->
      case List.keyfind(attrs, name, 0) do
        nil -> nil
        {_, "true"} -> true
        {_, "false"} -> false
        {_, ~s("bdl")} -> "bdl"
        {_, ~s("bld")} -> "bld"
        {_, "0x7F800000 : f32"} -> :infinity
        {_, "0xFF800000 : f32"} -> :neg_infinity
        {_, text} -> parse_number(text)
      end
    end

    workspace = Enum.any?(results, &(elem(&1, 0) == "workspace"))

    case target do
      "xla_ssm_selective_scan_" <> _ ->
        [
          delta_softplus: value.("delta_softplus"),
          layout: value.("layout"),
          checkpoint_len: value.("checkpoint_len") || 0,
          workspace: workspace
        ]

      "xla_ssm_ssd_" <> kind ->
        base = [
          chunk_size: value.("chunk_size"),
          dt_softplus: value.("dt_softplus"),
          dt_limit: {value.("dt_min"), value.("dt_max")},
          workspace: workspace
        ]

        if kind == "fwd", do: base ++ [save_chunk_states: value.("save_chunk_states")], else: base

      "xla_ssm_causal_conv1d_" <> _ ->
        [silu: value.("silu"), layout: value.("layout")]

      _ ->
        [dt_softplus: value.("dt_softplus")]
    end
  end

  defp parse_number(text) do
    [number, _type] = String.split(text, " : ")
    if String.contains?(number, [".", "e"]), do: String.to_float(number), else: String.to_integer(number)
  end
end
