defmodule XlaSsm.Reference do
  @moduledoc """
  Plain-Nx implementations of every target, in f32: the `Nx.block/4` fallbacks.

  Each function takes the operands as a map (the keys of `XlaSsm.Spec`) and the `XlaSsm.Spec`
  options of the call, and returns exactly the target's results in order (a tuple, or a tensor
  when there is one), workspace included (zeros): inside `defn` the block's result types are
  taken from the fallback, so it must match the custom call result for result. They run on any
  Nx backend (the sequence recurrences are `while` loops), and inside `defn` they are what EXLA
  compiles where it has no custom call (`EXLA.CustomCall` returns `:skip`).

  Packed sequences (`cu_seqlens`) follow the boundary rule of docs/selective_scan_fwd.md at every
  step: the loops look the boundaries up as tensors, so they need no concrete values and trace
  inside `defn` as they run eagerly. An unpacked call is one sequence `[0, seqlen)` per batch row.
  The boundaries are not checked here (the CPU target does).

  The backward targets ignore the forward's residuals (checkpoints, chunk_states) and recompute:
  the selective scan's and SSD's run the backward recurrence of docs/selective_scan_bwd.md over
  the recomputed states (written out: Nx 0.13's `grad` through a `while` loop that slices at its
  counter gives wrong results), causal conv1d's is Nx's `grad` of its forward (no loop).
  """

  import Nx.Defn

  alias XlaSsm.Spec

  @f32 {:f, 32}

  ## ----------------------------------------------------------------- selective scan

  @doc "`xla_ssm_selective_scan_fwd`: `{out, final_state[, checkpoints][, workspace]}`."
  def selective_scan_fwd(ops, opts) do
    call = Spec.selective_scan_fwd(ops, opts)
    {y, h, checkpoints} = scan_forward(ops, opts, opts[:checkpoint_len] || 0)
    finish(call, %{"out" => y, "final_state" => h, "checkpoints" => checkpoints})
  end

  @doc "`xla_ssm_selective_scan_bwd`: the gradients of every operand, then the workspace."
  def selective_scan_bwd(ops, opts) do
    call = Spec.selective_scan_bwd(ops, opts)
    {cotangents, primals} = Map.split(ops, [:checkpoints, :dout, :dfinal_state])
    grads = scan_backward(primals, cotangents.dout, cotangents[:dfinal_state], opts)

    names = %{
      u: "du",
      delta: "ddelta",
      a: "dA",
      b: "dB",
      c: "dC",
      d: "dD",
      z: "dz",
      delta_bias: "ddelta_bias",
      initial_state: "dinitial_state"
    }

    finish(call, Map.new(grads, fn {key, g} -> {names[key], g} end))
  end

  # The backward recurrence of docs/selective_scan_bwd.md, written out (rather than Nx's grad of
  # the forward: Nx 0.13's gradient through a `while` that slices at its counter is wrong).
  # Returns the gradients by operand key, f32, in the operands' layouts.
  defp scan_backward(ops, dout, dfinal, opts) do
    bld = opts[:layout] in ["bld", :bld]
    to_bdl = fn x -> if bld, do: Nx.transpose(x, axes: [0, 2, 1]), else: x end
    u = ops.u |> f32() |> to_bdl.()
    {batch, dim, _seqlen} = Nx.shape(u)
    a = f32(ops.a)
    dstate = Nx.axis_size(a, 1)
    raw = ops.delta |> f32() |> to_bdl.()
    raw = if bias = ops[:delta_bias], do: Nx.add(raw, Nx.reshape(f32(bias), {1, dim, 1})), else: raw
    dt = if opts[:delta_softplus], do: softplus(raw), else: raw
    {b_seq, c_seq} = {bc_seq(ops.b, bld, dim, dstate), bc_seq(ops.c, bld, dim, dstate)}
    seqs = sequences(ops, batch, dim, dstate, Nx.axis_size(u, 2))
    {ys, history} = scan_history(dt, u, a, b_seq, c_seq, seqs.h_init, seqs.cu, seqs.h0s)
    dout = dout |> f32() |> to_bdl.()
    y_pre = if d = ops[:d], do: Nx.add(ys, Nx.multiply(Nx.reshape(f32(d), {1, dim, 1}), u)), else: ys
    z = if z = ops[:z], do: z |> f32() |> to_bdl.()
    dy = if z, do: Nx.multiply(dout, silu(z)), else: dout
    g_finals = if dfinal, do: to_rows(f32(dfinal), seqs), else: Nx.broadcast(Nx.tensor(0.0), seqs.h0s)

    {du, ddt, da, db, dc, g0} = scan_reverse(dt, u, a, b_seq, c_seq, seqs.cu, seqs.h0s, history, dy, g_finals)
    g0 = from_rows(g0, seqs)
    du = if d = ops[:d], do: Nx.add(du, Nx.multiply(Nx.reshape(f32(d), {1, dim, 1}), dy)), else: du
    ddelta = if opts[:delta_softplus], do: Nx.multiply(ddt, Nx.sigmoid(raw)), else: ddt

    from_seq = fn acc, like ->
      case Nx.rank(like) do
        4 when bld -> Nx.transpose(acc, axes: [0, 3, 1, 2])
        4 -> acc
        2 -> Nx.reshape(acc, {dim, dstate})
      end
    end

    %{u: to_bdl.(du), delta: to_bdl.(ddelta), a: da, b: from_seq.(db, ops.b), c: from_seq.(dc, ops.c)}
    |> put_if(ops[:d], :d, fn -> Nx.sum(Nx.multiply(dy, u), axes: [0, 2]) end)
    |> put_if(z, :z, fn -> to_bdl.(Nx.multiply(Nx.multiply(dout, y_pre), silu_grad(z))) end)
    |> put_if(ops[:delta_bias], :delta_bias, fn -> Nx.sum(ddelta, axes: [0, 2]) end)
    |> put_if(ops[:initial_state], :initial_state, fn -> g0 end)
  end

  defp put_if(map, nil, _key, _fun), do: map
  defp put_if(map, _present, key, fun), do: Map.put(map, key, fun.())

  # B or C as (batch or 1, groups, dstate, seqlen or 1); time-invariant ones as dim groups.
  defp bc_seq(bc, bld, dim, dstate) do
    case Nx.rank(bc) do
      4 when bld -> bc |> f32() |> Nx.transpose(axes: [0, 2, 3, 1])
      4 -> f32(bc)
      2 -> bc |> f32() |> Nx.reshape({1, dim, dstate, 1})
    end
  end

  # The forward, keeping every step's state: ({batch, dim, seqlen} y, {batch, dim, seqlen,
  # dstate} states after each step).
  defnp scan_history(dt, u, a, b_seq, c_seq, h_init, cu, h0s) do
    ys = Nx.broadcast(0.0, u)
    history = history_buffer(h_init, u)
    seqlen = Nx.axis_size(u, 2)

    {_i, _h, ys, history, _} =
      while {i = 0, h = h_init, ys, history, {dt, u, a, b_seq, c_seq, cu, h0s}}, i < seqlen do
        {s, first, _last} = sequence_at(cu, i)
        h = Nx.select(first, seq_row(h0s, s), h)
        dt_l = step(dt, i)
        h = Nx.exp(Nx.new_axis(dt_l, 2) * a) * h + Nx.new_axis(dt_l * step(u, i), 2) * bc_step(b_seq, i, h)
        y_l = Nx.sum(h * bc_step(c_seq, i, h), axes: [2])
        ys = Nx.put_slice(ys, [0, 0, i], Nx.new_axis(y_l, 2))
        history = Nx.put_slice(history, [0, 0, i, 0], Nx.new_axis(h, 2))
        {i + 1, h, ys, history, {dt, u, a, b_seq, c_seq, cu, h0s}}
      end

    {ys, history}
  end

  deftransformp history_buffer(h0, u) do
    {batch, dim, dstate} = Nx.shape(h0)
    Nx.broadcast(Nx.tensor(0.0), {batch, dim, Nx.axis_size(u, 2), dstate})
  end

  # Steps l = seqlen - 1 .. 0 with g = dL/dh[l] (docs/selective_scan_bwd.md):
  #   g = a[l+1] g[l+1] + C[l] dy[l];  du = sum_n g dt B;  ddt = sum_n g (B u + A a[l] h[l-1]);
  #   dA += g a[l] h[l-1] dt;  dB += g dt u;  dC += dy h[l];  dinitial_state = a[l] g[l] at a
  #   sequence's first step l. A sequence's last step starts from its final state's cotangent
  #   (g_finals, rows like h0s) instead of the next step's: no gradient crosses a boundary. An
  #   empty sequence's dinitial_state is its dfinal_state (the rows start as g_finals).
  defnp scan_reverse(dt, u, a, b_seq, c_seq, cu, h0s, history, dy, g_finals) do
    seqlen = Nx.axis_size(u, 2)
    zeros = Nx.broadcast(0.0, u)
    da = Nx.broadcast(0.0, a)
    db = Nx.broadcast(0.0, b_seq)
    dc = Nx.broadcast(0.0, c_seq)
    like_h = history_step(history, 0)

    {_i, _carry, g0, du, ddt, da, db, dc, _} =
      while {i = 0, carry = Nx.broadcast(0.0, like_h), g0 = g_finals, du = zeros, ddt = zeros, da, db, dc,
             {dt, u, a, b_seq, c_seq, cu, h0s, history, dy, g_finals}},
            i < seqlen do
        l = seqlen - 1 - i
        {s, first, last} = sequence_at(cu, l)
        carry = Nx.select(last, seq_row(g_finals, s), carry)
        dt_l = step(dt, l)
        u_l = step(u, l)
        h_l = history_step(history, l)
        b_l = bc_step(b_seq, l, h_l)
        c_l = bc_step(c_seq, l, h_l)
        h_prev = Nx.select(first, seq_row(h0s, s), history_step(history, Nx.max(l - 1, 0)))
        decay = Nx.exp(Nx.new_axis(dt_l, 2) * a)
        g = carry + c_l * Nx.new_axis(step(dy, l), 2)
        du = Nx.put_slice(du, [0, 0, l], Nx.new_axis(Nx.sum(g * b_l, axes: [2]) * dt_l, 2))
        ddt_l = Nx.sum(g * (b_l * Nx.new_axis(u_l, 2) + a * decay * h_prev), axes: [2])
        ddt = Nx.put_slice(ddt, [0, 0, l], Nx.new_axis(ddt_l, 2))
        da = da + Nx.sum(g * decay * h_prev * Nx.new_axis(dt_l, 2), axes: [0])
        db = bc_accumulate(db, g * Nx.new_axis(dt_l * u_l, 2), l)
        dc = bc_accumulate(dc, Nx.new_axis(step(dy, l), 2) * h_l, l)
        carry = decay * g
        g0 = Nx.select(first, Nx.put_slice(g0, [s, 0, 0, 0], Nx.new_axis(carry, 0)), g0)
        {i + 1, carry, g0, du, ddt, da, db, dc, {dt, u, a, b_seq, c_seq, cu, h0s, history, dy, g_finals}}
      end

    {du, ddt, da, db, dc, g0}
  end

  deftransformp history_step(history, l) do
    {batch, dim, _, dstate} = Nx.shape(history)
    history |> Nx.slice([0, 0, l, 0], [batch, dim, 1, dstate]) |> Nx.squeeze(axes: [2])
  end

  # Adds a step's per-channel (batch, dim, dstate) gradient of B or C into its accumulator, shaped
  # like bc_seq: summed over the group's channels at step l, or over the batch (time-invariant).
  deftransformp bc_accumulate(acc, per_channel, l) do
    {bb, groups, dstate, len} = Nx.shape(acc)
    {batch, dim, _} = Nx.shape(per_channel)

    if len == 1 do
      Nx.add(acc, per_channel |> Nx.sum(axes: [0]) |> Nx.reshape({bb, dim, dstate, 1}))
    else
      step_sum = per_channel |> Nx.reshape({batch, groups, div(dim, groups), dstate}) |> Nx.sum(axes: [2])
      Nx.put_slice(acc, [0, 0, 0, l], Nx.new_axis(step_sum, 3))
    end
  end

  # The recurrence of docs/selective_scan_fwd.md in f32. Returns {y (u's layout, f32),
  # final_state, checkpoints or nil}.
  defp scan_forward(ops, opts, checkpoint_len) do
    bld = opts[:layout] in ["bld", :bld]
    to_bdl = fn x -> if bld, do: Nx.transpose(x, axes: [0, 2, 1]), else: x end
    u = ops.u |> f32() |> to_bdl.()
    {batch, dim, seqlen} = Nx.shape(u)
    a = f32(ops.a)
    dstate = Nx.axis_size(a, 1)
    dt = ops.delta |> f32() |> to_bdl.()
    dt = if bias = ops[:delta_bias], do: Nx.add(dt, Nx.reshape(f32(bias), {1, dim, 1})), else: dt
    dt = if opts[:delta_softplus], do: softplus(dt), else: dt

    seqs = sequences(ops, batch, dim, dstate, seqlen)
    n_checkpoints = Spec.n_checkpoints(seqlen, checkpoint_len)
    {b_seq, c_seq} = {bc_seq(ops.b, bld, dim, dstate), bc_seq(ops.c, bld, dim, dstate)}

    {ys, finals, checkpoints} =
      scan_loop(dt, u, a, b_seq, c_seq, seqs.h_init, seqs.cu, seqs.h0s,
        checkpoint_len: checkpoint_len,
        n_checkpoints: n_checkpoints
      )

    y = if d = ops[:d], do: Nx.add(ys, Nx.multiply(Nx.reshape(f32(d), {1, dim, 1}), u)), else: ys
    y = if z = ops[:z], do: Nx.multiply(y, silu(z |> f32() |> to_bdl.())), else: y
    {to_bdl.(y), from_rows(finals, seqs), if(checkpoint_len > 0, do: checkpoints, else: nil)}
  end

  # The sequences a call scans. Unpacked: one, [0, seqlen), of every batch row; packed (batch 1):
  # those of cu_seqlens. `h0s` holds the initial states as rows {sequences, batch, dim, dstate};
  # `h_init` is the state before the rule at step 0, which checkpoint 0 holds: 0 for a packed scan
  # (as the library's), the initial state for an unpacked one (which the rule then sets again).
  defp sequences(ops, batch, dim, dstate, seqlen) do
    zeros = fn rows -> Nx.broadcast(Nx.tensor(0.0), {rows, dim, dstate}) end

    case ops[:cu_seqlens] do
      nil ->
        h0 = if h = ops[:initial_state], do: f32(h), else: zeros.(batch)
        %{packed: false, cu: Nx.tensor([0, seqlen], type: {:s, 32}), h0s: Nx.new_axis(h0, 0), h_init: h0}

      cu ->
        h0 = if h = ops[:initial_state], do: f32(h), else: zeros.(Nx.axis_size(cu, 0) - 1)
        %{packed: true, cu: Nx.as_type(cu, {:s, 32}), h0s: Nx.new_axis(h0, 1), h_init: zeros.(batch)}
    end
  end

  # Rows {sequences, batch, dim, dstate} to the states' shape and back: (batch, dim, dstate)
  # unpacked, (num_seqs, dim, dstate) packed.
  defp from_rows(rows, %{packed: true}), do: Nx.squeeze(rows, axes: [1])
  defp from_rows(rows, %{packed: false}), do: Nx.squeeze(rows, axes: [0])
  defp to_rows(states, %{packed: true}), do: Nx.new_axis(states, 1)
  defp to_rows(states, %{packed: false}), do: Nx.new_axis(states, 0)

  # The sequence s that holds step i (the last one that starts at or before it: empty ones hold no
  # step), whether i is its first step and whether it is its last. Bad boundaries give some s in
  # range, never an error.
  deftransformp sequence_at(cu, i) do
    n = Nx.axis_size(cu, 0) - 1

    s =
      cu
      |> Nx.slice([0], [n])
      |> Nx.less_equal(i)
      |> Nx.sum()
      |> Nx.as_type({:s, 32})
      |> Nx.subtract(1)
      |> Nx.clip(0, n - 1)

    at = fn k -> cu |> Nx.slice([k], [1]) |> Nx.squeeze() end
    {s, Nx.equal(at.(s), i), Nx.equal(at.(Nx.add(s, 1)), Nx.add(i, 1))}
  end

  # Row s of {sequences, batch, dim, dstate}: (batch, dim, dstate).
  deftransformp seq_row(rows, s) do
    {_, batch, dim, dstate} = Nx.shape(rows)
    rows |> Nx.slice([s, 0, 0, 0], [1, batch, dim, dstate]) |> Nx.squeeze(axes: [0])
  end

  # h = exp(dt A) h + dt u B; y = <C, h>, one step per iteration, the boundary rule before each
  # step and a sequence's final state after its last. Every tensor the body reads is carried in
  # the loop state.
  defnp scan_loop(dt, u, a, b_seq, c_seq, h_init, cu, h0s, opts \\ []) do
    ys = Nx.broadcast(0.0, u)
    checkpoints = checkpoint_buffer(h_init, opts)
    seqlen = Nx.axis_size(u, 2)

    {_i, _h, ys, finals, checkpoints, _} =
      while {i = 0, h = h_init, ys, finals = h0s, checkpoints, {dt, u, a, b_seq, c_seq, cu, h0s}}, i < seqlen do
        # Before the rule: a checkpoint is the state entering its step as the backward applies it.
        checkpoints = save_checkpoint(checkpoints, h, i, opts)
        {s, first, last} = sequence_at(cu, i)
        h = Nx.select(first, seq_row(h0s, s), h)
        dt_l = step(dt, i)
        b_l = bc_step(b_seq, i, h)
        c_l = bc_step(c_seq, i, h)
        h = Nx.exp(Nx.new_axis(dt_l, 2) * a) * h + Nx.new_axis(dt_l * step(u, i), 2) * b_l
        y_l = Nx.sum(h * c_l, axes: [2])
        ys = Nx.put_slice(ys, [0, 0, i], Nx.new_axis(y_l, 2))
        finals = Nx.select(last, Nx.put_slice(finals, [s, 0, 0, 0], Nx.new_axis(h, 0)), finals)
        {i + 1, h, ys, finals, checkpoints, {dt, u, a, b_seq, c_seq, cu, h0s}}
      end

    {ys, finals, checkpoints}
  end

  # x[:, :, i] of a (batch, dim, seqlen) tensor.
  deftransformp step(x, i) do
    {batch, dim, _} = Nx.shape(x)
    x |> Nx.slice([0, 0, i], [batch, dim, 1]) |> Nx.squeeze(axes: [2])
  end

  # Step i of (batch or 1, groups, dstate, seqlen or 1) B/C, spread over the channels of
  # `like` (batch, dim, dstate): (batch or 1, dim, dstate).
  deftransformp bc_step(bc, i, like) do
    {bb, groups, dstate, len} = Nx.shape(bc)
    dim = Nx.axis_size(like, 1)
    at = if len == 1, do: 0, else: i

    bc
    |> Nx.slice([0, 0, 0, at], [bb, groups, dstate, 1])
    |> Nx.reshape({bb, groups, 1, dstate})
    |> Nx.broadcast({bb, groups, div(dim, groups), dstate})
    |> Nx.reshape({bb, dim, dstate})
  end

  # Nx has no zero-sized dimensions: without checkpoints the loop carries a scalar instead.
  deftransformp checkpoint_buffer(h0, opts) do
    {batch, dim, dstate} = Nx.shape(h0)

    case opts[:n_checkpoints] do
      0 -> Nx.tensor(0.0)
      n -> Nx.broadcast(Nx.tensor(0.0), {batch, dim, n, dstate})
    end
  end

  # Checkpoint k is the state entering step k * checkpoint_len.
  deftransformp save_checkpoint(checkpoints, h, i, opts) do
    ck = opts[:checkpoint_len]

    if ck > 0 and opts[:n_checkpoints] > 0 do
      k = Nx.quotient(i, ck)
      stored = Nx.put_slice(checkpoints, [0, 0, k, 0], Nx.new_axis(h, 2))
      Nx.select(Nx.equal(Nx.remainder(i, ck), 0), stored, checkpoints)
    else
      checkpoints
    end
  end

  ## ---------------------------------------------------------------------------- SSD

  @doc "`xla_ssm_ssd_fwd`: `{y, final_states[, chunk_states][, workspace]}`."
  def ssd_fwd(ops, opts) do
    call = Spec.ssd_fwd(ops, opts)
    chunk = if opts[:save_chunk_states], do: opts[:chunk_size], else: 0
    {y, h, chunk_states} = ssd_forward(ops, opts, chunk)
    finish(call, %{"y" => y, "final_states" => h, "chunk_states" => chunk_states})
  end

  @doc "`xla_ssm_ssd_bwd`: the gradients of every operand, then the workspace."
  def ssd_bwd(ops, opts) do
    call = Spec.ssd_bwd(ops, opts)
    {cotangents, primals} = Map.split(ops, [:chunk_states, :dy, :dfinal_states])
    {batch, seqlen, heads, headdim} = Nx.shape(primals.x)
    dstate = Nx.axis_size(primals.b, 3)
    dim = heads * headdim
    {scan_ops, raw, v} = ssd_as_scan(primals, opts)
    dfinal = if d = cotangents[:dfinal_states], do: Nx.reshape(d, {batch, dim, dstate})
    dy = Nx.reshape(cotangents.dy, {batch, seqlen, dim})
    g = scan_backward(scan_ops, dy, dfinal, layout: "bld", delta_softplus: false)

    # Back through the per-channel expansion, the clamp (it passes the gradient where
    # dt_min <= v <= dt_max), softplus and the bias.
    d_eff = g.delta |> Nx.reshape({batch, seqlen, heads, headdim}) |> Nx.sum(axes: [3])
    ddt = Nx.multiply(d_eff, clamp_mask(v, Spec.effective_dt_limit(opts[:dt_limit] || {0.0, :infinity})))
    ddt = if opts[:dt_softplus], do: Nx.multiply(ddt, Nx.sigmoid(raw)), else: ddt

    grads =
      %{
        "dx" => Nx.reshape(g.u, {batch, seqlen, heads, headdim}),
        "ddt" => ddt,
        "dA" => g.a |> Nx.reshape({heads, headdim * dstate}) |> Nx.sum(axes: [1]),
        "dB" => g.b,
        "dC" => g.c
      }
      |> put_if(primals[:d], "dD", fn ->
        per_channel = Nx.reshape(g.d, {heads, headdim})
        if Nx.rank(primals.d) == 1, do: Nx.sum(per_channel, axes: [1]), else: per_channel
      end)
      |> put_if(primals[:z], "dz", fn -> Nx.reshape(g.z, {batch, seqlen, heads, headdim}) end)
      |> put_if(primals[:dt_bias], "ddt_bias", fn -> Nx.sum(ddt, axes: [0, 1]) end)
      |> put_if(primals[:initial_states], "dinitial_states", fn ->
        Nx.reshape(g.initial_state, {batch, heads, headdim, dstate})
      end)

    finish(call, grads)
  end

  defp ssd_forward(ops, opts, chunk_size) do
    {batch, seqlen, heads, headdim} = Nx.shape(ops.x)
    dstate = Nx.axis_size(ops.b, 3)
    {scan_ops, _raw, _v} = ssd_as_scan(ops, opts)
    {y, h, checkpoints} = scan_forward(scan_ops, [layout: "bld", delta_softplus: false], chunk_size)
    states = Nx.reshape(h, {batch, heads, headdim, dstate})

    chunk_states =
      if checkpoints, do: Nx.reshape(checkpoints, {batch, heads, headdim, Nx.axis_size(checkpoints, 2), dstate})

    {Nx.reshape(y, {batch, seqlen, heads, headdim}), states, chunk_states}
  end

  # Per head, SSD is a selective scan over heads * headdim channels, channel-last (docs/ssd.md,
  # "the generic path"): the clamped dt broadcast over headdim is its delta, A per head its
  # (dim, dstate) A, the groups of B/C its groups; chunk_states are its checkpoints.
  # Returns {scan operands, dt + bias, softplus of it (before the clamp)}.
  defp ssd_as_scan(ops, opts) do
    {batch, seqlen, heads, headdim} = Nx.shape(ops.x)
    dstate = Nx.axis_size(ops.b, 3)
    dim = heads * headdim
    raw = f32(ops.dt)
    raw = if bias = ops[:dt_bias], do: Nx.add(raw, f32(bias)), else: raw
    v = if opts[:dt_softplus], do: softplus(raw), else: raw
    dt = clamp(v, Spec.effective_dt_limit(opts[:dt_limit] || {0.0, :infinity}))

    per_channel = fn t ->
      t |> Nx.new_axis(-1) |> Nx.broadcast({batch, seqlen, heads, headdim}) |> Nx.reshape({batch, seqlen, dim})
    end

    a =
      ops.a |> f32() |> Nx.reshape({heads, 1, 1}) |> Nx.broadcast({heads, headdim, dstate}) |> Nx.reshape({dim, dstate})

    d =
      case ops[:d] do
        nil -> nil
        d -> d |> f32() |> Nx.reshape({heads, :auto}) |> Nx.broadcast({heads, headdim}) |> Nx.reshape({dim})
      end

    scan_ops =
      %{
        u: Nx.reshape(ops.x, {batch, seqlen, dim}),
        delta: per_channel.(dt),
        a: a,
        b: ops.b,
        c: ops.c,
        d: d,
        z: if(z = ops[:z], do: Nx.reshape(z, {batch, seqlen, dim})),
        initial_state: if(h0 = ops[:initial_states], do: Nx.reshape(h0, {batch, dim, dstate}))
      }
      |> Enum.reject(fn {_, value} -> is_nil(value) end)
      |> Map.new()

    {scan_ops, raw, v}
  end

  defp clamp_mask(v, {lo, hi}) do
    mask = Nx.broadcast(Nx.tensor(1.0), Nx.shape(v))
    mask = if is_number(lo), do: Nx.multiply(mask, Nx.greater_equal(v, lo)), else: mask
    if is_number(hi), do: Nx.multiply(mask, Nx.less_equal(v, hi)), else: mask
  end

  defp clamp(dt, {lo, hi}) do
    dt = if is_number(lo), do: Nx.max(dt, lo), else: dt
    if is_number(hi), do: Nx.min(dt, hi), else: dt
  end

  ## ------------------------------------------------------------------------- decode

  @doc "`xla_ssm_selective_state_update`: `{out, state}` (a new state; the operand is untouched)."
  def selective_state_update(ops, opts) do
    call = Spec.selective_state_update(ops, opts)
    {out, state} = state_update(ops.state, ops.x, ops, opts[:dt_softplus])
    finish(call, %{"out" => out, "state" => state})
  end

  # One token: state rows (through state_batch_indices), then the update and the output.
  defp state_update(state, x, ops, dt_softplus) do
    dim = Nx.axis_size(x, 1)
    xf = f32(x)
    dt = f32(ops.dt)
    dt = if bias = ops[:dt_bias], do: Nx.add(dt, f32(bias)), else: dt
    dt = if dt_softplus, do: softplus(dt), else: dt
    b = spread_groups(f32(ops.b), dim)
    c = spread_groups(f32(ops.c), dim)
    ix = ops[:state_batch_indices]
    rows = if ix, do: Nx.take(state, Nx.max(ix, 0), axis: 0), else: state

    h =
      Nx.add(
        Nx.multiply(Nx.exp(Nx.multiply(Nx.new_axis(dt, 2), f32(ops.a))), f32(rows)),
        Nx.multiply(Nx.new_axis(Nx.multiply(dt, xf), 2), b)
      )

    # The state is stored in its own type; the output reads the stored value.
    h = Nx.as_type(h, state.type)
    y = Nx.sum(Nx.multiply(f32(h), c), axes: [2])
    y = if d = ops[:d], do: Nx.add(y, Nx.multiply(f32(d), xf)), else: y
    y = if z = ops[:z], do: Nx.multiply(y, silu(f32(z))), else: y

    if ix do
      valid = ix |> Nx.greater_equal(0) |> Nx.new_axis(1) |> Nx.broadcast(Nx.shape(y))
      {Nx.select(valid, y, 0.0), scatter_rows(state, h, ix)}
    else
      {y, h}
    end
  end

  # (batch, groups, dstate) -> (batch, dim, dstate): channel d reads group d / (dim / groups).
  defp spread_groups(bc, dim) do
    {batch, groups, dstate} = Nx.shape(bc)

    bc
    |> Nx.new_axis(2)
    |> Nx.broadcast({batch, groups, div(dim, groups), dstate})
    |> Nx.reshape({batch, dim, dstate})
  end

  # The pool with row i of `rows` at slot ix[i]; negative entries (padding) write nothing.
  defp scatter_rows(pool, rows, ix) do
    {slots, batch} = {Nx.axis_size(pool, 0), Nx.axis_size(rows, 0)}

    if batch == 0 do
      pool
    else
      hits = Nx.equal(Nx.reshape(ix, {batch, 1}), Nx.iota({1, slots}, axis: 1))
      # Indices are distinct, so a written slot has exactly one row.
      gathered = Nx.take(rows, Nx.argmax(hits, axis: 0), axis: 0)
      mask_shape = pool |> Nx.shape() |> Tuple.to_list() |> Enum.with_index(fn n, i -> if i == 0, do: n, else: 1 end)
      # Nx.select takes its shape from the predicate: spread it over the rows.
      written = hits |> Nx.any(axes: [0]) |> Nx.reshape(List.to_tuple(mask_shape)) |> Nx.broadcast(Nx.shape(pool))
      Nx.select(written, gathered, pool)
    end
  end

  @doc "`xla_ssm_causal_conv1d_fwd`: `out`."
  def causal_conv1d_fwd(ops, opts) do
    call = Spec.causal_conv1d_fwd(ops, opts)
    finish(call, %{"out" => conv_forward(ops, opts)})
  end

  @doc "`xla_ssm_causal_conv1d_bwd`: `{dx, dweight[, dbias][, dinitial_states]}`."
  def causal_conv1d_bwd(ops, opts) do
    call = Spec.causal_conv1d_bwd(ops, opts)
    {dout, primals} = Map.pop!(ops, :dout)
    grads = conv_vjp(primals, dout, Keyword.take(opts, [:silu, :layout]))
    names = %{x: "dx", weight: "dweight", bias: "dbias", initial_states: "dinitial_states"}
    finish(call, Map.new(grads, fn {key, g} -> {names[key], g} end))
  end

  defn conv_vjp(primals, dout, opts \\ []) do
    grad(primals, fn p -> conv_loss(p, dout, opts) end)
  end

  deftransformp conv_loss(p, dout, opts) do
    Nx.sum(Nx.multiply(conv_forward(p, opts), Nx.as_type(dout, @f32)))
  end

  # out[t] = act(bias + sum_k weight[k] * xpad[t - (width - 1) + k]), in x's layout, f32.
  defp conv_forward(ops, opts) do
    bld = opts[:layout] in ["bld", :bld]
    to_bdl = fn x -> if bld, do: Nx.transpose(x, axes: [0, 2, 1]), else: x end
    x = ops.x |> f32() |> to_bdl.()
    {batch, dim, seqlen} = Nx.shape(x)
    width = Nx.axis_size(ops.weight, 1)

    h0 =
      if h = ops[:initial_states],
        do: f32(h),
        else: Nx.broadcast(Nx.tensor(0.0), {batch, dim, width - 1})

    out = conv_taps(Nx.concatenate([h0, x], axis: 2), f32(ops.weight), seqlen)
    out = if bias = ops[:bias], do: Nx.add(out, Nx.reshape(f32(bias), {1, dim, 1})), else: out
    out = if opts[:silu], do: silu(out), else: out
    to_bdl.(out)
  end

  # sum_k weight[:, k] * xpad[:, :, k .. k + seqlen) over the padded (batch, dim, width-1+seqlen).
  defp conv_taps(xpad, weight, seqlen) do
    {batch, dim, _} = Nx.shape(xpad)
    width = Nx.axis_size(weight, 1)

    for k <- 0..(width - 1), reduce: Nx.broadcast(Nx.tensor(0.0), {batch, dim, seqlen}) do
      acc ->
        w_k = weight |> Nx.slice([0, k], [dim, 1]) |> Nx.reshape({1, dim, 1})
        Nx.add(acc, Nx.multiply(w_k, Nx.slice(xpad, [0, 0, k], [batch, dim, seqlen])))
    end
  end

  @doc "`xla_ssm_causal_conv1d_update`: `{out, conv_state}` (a new state)."
  def causal_conv1d_update(ops, opts) do
    call = Spec.causal_conv1d_update(ops, opts)
    {out, state} = conv_update(ops.x, ops.conv_state, ops.weight, ops[:bias], ops[:state_batch_indices], opts)
    finish(call, %{"out" => out, "conv_state" => state})
  end

  # New tokens through the conv state rows; the last width - 1 inputs become the new state.
  defp conv_update(x, pool, weight, bias, ix, opts) do
    bld = opts[:layout] in ["bld", :bld]
    one_token = Nx.rank(x) == 2

    xs =
      cond do
        one_token -> Nx.new_axis(x, 2)
        bld -> Nx.transpose(x, axes: [0, 2, 1])
        true -> x
      end

    {batch, dim, seqlen} = Nx.shape(xs)
    width = Nx.axis_size(weight, 1)
    rows = if ix, do: Nx.take(pool, Nx.max(ix, 0), axis: 0), else: pool
    xpad = Nx.concatenate([f32(rows), f32(xs)], axis: 2)
    out = conv_taps(xpad, f32(weight), seqlen)
    out = if bias, do: Nx.add(out, Nx.reshape(f32(bias), {1, dim, 1})), else: out
    out = if opts[:silu], do: silu(out), else: out
    new_rows = xpad |> Nx.slice([0, 0, seqlen], [batch, dim, width - 1]) |> Nx.as_type(pool.type)

    {out, state} =
      if ix do
        valid = ix |> Nx.greater_equal(0) |> Nx.reshape({batch, 1, 1}) |> Nx.broadcast(Nx.shape(out))
        {Nx.select(valid, out, 0.0), scatter_rows(pool, new_rows, ix)}
      else
        {out, new_rows}
      end

    out =
      cond do
        one_token -> Nx.squeeze(out, axes: [2])
        bld -> Nx.transpose(out, axes: [0, 2, 1])
        true -> out
      end

    {out, state}
  end

  @doc "`xla_ssm_mamba_decode_step`: `{out, conv_state, ssm_state}`."
  def mamba_decode_step(ops, opts) do
    call = Spec.mamba_decode_step(ops, opts)
    ix = ops[:state_batch_indices]
    {xc, conv_state} = conv_update(ops.x, ops.conv_state, ops.conv_weight, ops[:conv_bias], ix, silu: true)
    {out, ssm_state} = state_update(ops.ssm_state, xc, ops, opts[:dt_softplus])
    finish(call, %{"out" => out, "conv_state" => conv_state, "ssm_state" => ssm_state})
  end

  ## ------------------------------------------------------------------------ helpers

  # The target's results in order, each cast to its type and checked against its shape; the
  # workspace as zeros.
  defp finish(%Spec.Call{results: results}, values) do
    tensors =
      Enum.map(results, fn
        {"workspace", shape, type} ->
          Nx.broadcast(Nx.tensor(0, type: type), shape)

        {name, shape, type} ->
          value = Map.get(values, name) || raise "XlaSsm.Reference: no value for result #{name}"

          unless Nx.shape(value) == shape do
            raise "XlaSsm.Reference: result #{name} has shape #{inspect(Nx.shape(value))}, the target's is #{inspect(shape)}"
          end

          Nx.as_type(value, type)
      end)

    case tensors do
      [one] -> one
      many -> List.to_tuple(many)
    end
  end

  defp f32(t), do: Nx.as_type(t, @f32)

  # log(1 + e^x), = x past 20 (as the kernels compute it).
  defp softplus(x) do
    Nx.select(Nx.greater(x, 20.0), x, Nx.log1p(Nx.exp(Nx.min(x, 20.0))))
  end

  defp silu(x), do: Nx.multiply(x, Nx.sigmoid(x))

  # silu'(x) = s (1 + x (1 - s)), s = sigmoid(x).
  defp silu_grad(x) do
    s = Nx.sigmoid(x)
    Nx.multiply(s, Nx.add(1, Nx.multiply(x, Nx.subtract(1, s))))
  end
end
