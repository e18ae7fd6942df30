defmodule XlaSsm do
  @moduledoc """
  Mamba's state-space kernels (libxla_ssm) for Nx: the selective scan, Mamba-2's SSD, and the
  decode-time state update and causal conv1d.

  Every function is an `Nx.block/4` (see `XlaSsm.Block`): under EXLA on the host or CUDA it
  lowers to the library's XLA custom call (load the library first with `load/0`); anywhere else
  (another backend or compiler, eager mode, other EXLA platforms) it runs `XlaSsm.Reference`,
  the same computation in plain Nx (f32, `while` loops). Inside `defn`, `selective_scan/6`,
  `ssd/6` and `causal_conv1d/3` have gradients through the library's backward targets
  (`Nx.Defn.Kernel.custom_grad/3`).

  Shapes, types and options are those of the library's docs (docs/*.md) and of the JAX binding;
  a bad operand raises `ArgumentError` naming it (`XlaSsm.Spec`). Leading batch dimensions beyond
  the documented ranks are not folded in: pass the documented ranks.
  """

  alias XlaSsm.Block

  @library_env "XLA_SSM_LIBRARY"
  @library_name "libxla_ssm.so"
  # The forward run under a gradient keeps the state every 32 steps for the backward (a multiple
  # of 32, as the JAX binding does).
  @checkpoint_len 32

  ## -------------------------------------------------------------------- the library

  @doc """
  Loads libxla_ssm into the process so that XLA finds its custom-call handlers: the library
  registers every target for "Host" and "CUDA" when it is loaded. Call it once, before the first
  compile of a computation that uses this module under EXLA (XLA looks handlers up at compile
  time). Loading again is a no-op.

  The library is `$XLA_SSM_LIBRARY` when set (no other place is then tried), else
  `priv/libxla_ssm.so` of this application, else, run from the xla-ssm source tree,
  `<repo>/target/release/libxla_ssm.so` (`cargo build --release`). Uses `EXLA.load_dylib/1`
  where EXLA has it, else `EXLA.NIF.load_dylib/1` (EXLA 0.12, 0.13).
  """
  @spec load() :: :ok
  def load do
    path = library_path()

    case :persistent_term.get({__MODULE__, :loaded}, nil) do
      ^path ->
        :ok

      _ ->
        :ok = load_dylib(path)
        :persistent_term.put({__MODULE__, :loaded}, path)
        :ok
    end
  end

  defp load_dylib(path) do
    cond do
      Code.ensure_loaded?(EXLA) and function_exported?(EXLA, :load_dylib, 1) ->
        apply(EXLA, :load_dylib, [path])

      Code.ensure_loaded?(EXLA.NIF) and function_exported?(EXLA.NIF, :load_dylib, 1) ->
        # dlopen(path, RTLD_NOW | RTLD_GLOBAL); raises with dlerror's text.
        apply(EXLA.NIF, :load_dylib, [path])

      true ->
        raise RuntimeError,
              "XlaSsm.load/0 needs EXLA >= 0.12 (EXLA.load_dylib/1 or EXLA.NIF.load_dylib/1); without EXLA the functions run their Nx fallbacks and need no library"
    end
  end

  @doc "Where `load/0` looks for the library, in order."
  @spec candidate_paths() :: [Path.t()]
  def candidate_paths do
    case System.get_env(@library_env) do
      env when env not in [nil, ""] ->
        # An explicit choice: never fall back silently to another build.
        [Path.expand(env)]

      _ ->
        priv =
          case :code.priv_dir(:xla_ssm) do
            {:error, _} -> []
            dir -> [Path.join(to_string(dir), @library_name)]
          end

        priv ++ source_tree_library()
    end
  end

  # Run from <repo>/bindings/elixir: the cargo release build of the repository.
  defp source_tree_library do
    binding = Path.expand("..", __DIR__)

    if Path.basename(binding) == "elixir" and Path.basename(Path.dirname(binding)) == "bindings" do
      [Path.join([binding, "..", "..", "target", "release", @library_name]) |> Path.expand()]
    else
      []
    end
  end

  @doc "The library `load/0` would load; raises naming every place looked in when none is found."
  @spec library_path() :: Path.t()
  def library_path do
    tried = candidate_paths()

    case Enum.find(tried, &File.regular?/1) do
      nil ->
        hint =
          if System.get_env(@library_env) not in [nil, ""],
            do: "#{@library_env} is set but names no file",
            else: "build it with `cargo build --release` or set #{@library_env}=/path/to/#{@library_name}"

        raise RuntimeError,
              "xla_ssm: cannot find #{@library_name}; looked in:\n" <>
                Enum.map_join(tried, "\n", &"  - #{&1}") <> "\n(#{hint})"

      path ->
        path
    end
  end

  ## ------------------------------------------------------------------- selective scan

  @doc """
  Mamba-1 selective scan (docs/selective_scan_fwd.md), target `xla_ssm_selective_scan_fwd`.

  `u`, `delta`: `{batch, dim, seqlen}` (layout "bdl") or `{batch, seqlen, dim}` ("bld"), f32,
  bf16 or f16; `a`: `{dim, dstate}` f32; `b`, `c`: time-varying `{batch, groups, dstate,
  seqlen}` ("bld": `{batch, seqlen, groups, dstate}`) or time-invariant `{dim, dstate}`, f32 or
  u's type.

  Options: `:d`, `:delta_bias` (`{dim}` f32), `:z` (like u), `:initial_state` (`{batch, dim,
  dstate}` f32), `:cu_seqlens`, `:delta_softplus` (false), `:return_final_state` (false),
  `:layout` ("bdl"), `:workspace` (true: give the CUDA kernel its scratch; see `XlaSsm.Spec`).

  Packed sequences: `cu_seqlens` (`{num_seqs + 1}` integers, passed as s32) holds the boundaries
  of `num_seqs` sequences laid one after another along seqlen of a batch-1 input: 0 first,
  non-decreasing, seqlen last (empty sequences allowed). The state starts again at every boundary
  (from `initial_state`, then `{num_seqs, dim, dstate}`, or zero) and `final_state` has one row
  per sequence (an empty one's is its initial state), as one call per sequence would give
  (docs/selective_scan_fwd.md, "Packed sequences"). Concrete boundaries are checked here
  (`ArgumentError`); traced ones (inside `defn`) are the caller's to get right: the CPU target
  refuses bad ones, the CUDA target cannot read them (undefined results, though never an access
  outside the buffers), the fallback does not check them.

  Returns `out` (like u), or `{out, final_state}` with `return_final_state: true`. Inside `defn`
  it is differentiable in every tensor argument but `cu_seqlens`: the gradient runs the forward
  again keeping checkpoints, then `xla_ssm_selective_scan_bwd`.
  """
  def selective_scan(u, delta, a, b, c, opts \\ []) do
    opts =
      Keyword.validate!(opts, [
        :d,
        :z,
        :delta_bias,
        :initial_state,
        :cu_seqlens,
        delta_softplus: false,
        return_final_state: false,
        layout: "bdl",
        workspace: true
      ])

    named =
      present(
        u: u,
        delta: delta,
        a: a,
        b: b,
        c: c,
        d: opts[:d],
        z: opts[:z],
        delta_bias: opts[:delta_bias],
        initial_state: opts[:initial_state],
        cu_seqlens: opts[:cu_seqlens]
      )

    named =
      for {key, t} <- named, do: {key, if(key == :cu_seqlens, do: boundaries!(t, named[:u], opts[:layout]), else: t)}

    spec_opts = Keyword.take(opts, [:delta_softplus, :layout, :workspace])
    tag = %Block.SelectiveScanFwd{operands: Keyword.keys(named), opts: spec_opts}
    %{"out" => out, "final_state" => final_state} = Block.run(tag, Keyword.values(named))

    {out, final_state} =
      if traced?(out) do
        grad = &scan_grads(named, spec_opts, opts[:return_final_state], {out, final_state}, &1)
        # The boundaries are integers: no gradient flows to them.
        differentiable = named |> Keyword.delete(:cu_seqlens) |> Keyword.values()
        Nx.Defn.Kernel.custom_grad({out, final_state}, differentiable, grad)
      else
        {out, final_state}
      end

    if opts[:return_final_state], do: {out, final_state}, else: out
  end

  # cu_seqlens as the target takes it (s32), from any integer tensor. Concrete boundaries are
  # checked here, as the JAX binding does: the CUDA target cannot check them and the fallback does
  # not; traced ones (inside defn) are the caller's.
  defp boundaries!(cu, u, layout) do
    case Nx.type(cu) do
      {kind, _} when kind in [:s, :u] -> :ok
      other -> raise ArgumentError, "selective_scan: cu_seqlens must be integers, got #{inspect(other)}"
    end

    cu = Nx.as_type(cu, {:s, 32})

    if not traced?(cu) and Nx.rank(cu) == 1 and Nx.rank(u) == 3 do
      seqlen = Nx.axis_size(u, if(layout in ["bld", :bld], do: 1, else: 2))
      values = Nx.to_flat_list(cu)
      sorted = values |> Enum.chunk_every(2, 1, :discard) |> Enum.all?(fn [a, b] -> a <= b end)

      unless List.first(values) == 0 and sorted and List.last(values) == seqlen do
        raise ArgumentError,
              "selective_scan: cu_seqlens must start at 0, never decrease and end at seqlen (= #{seqlen}), got #{inspect(values)}"
      end
    end

    cu
  end

  @scan_grad_names %{
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

  defp scan_grads(named, spec_opts, with_final, {out, final_state}, {g_out, g_final}) do
    keys = Keyword.keys(named)
    args = Keyword.values(named)
    opts = Keyword.put(spec_opts, :checkpoint_len, @checkpoint_len)
    %{"checkpoints" => checkpoints} = Block.run(%Block.SelectiveScanFwd{operands: keys, opts: opts}, args)
    # The final state's cotangent only where the caller could use it (else it is zero).
    cotangents =
      [checkpoints: checkpoints, dout: like(g_out, out)] ++
        if(with_final, do: [dfinal_state: like(g_final, final_state)], else: [])

    # cu_seqlens (last of the forward's operands, when given) goes to the backward too.
    tag = %Block.SelectiveScanBwd{operands: keys ++ Keyword.keys(cotangents), opts: opts}
    grads = Block.run(tag, args ++ Keyword.values(cotangents))
    for key <- keys, key != :cu_seqlens, do: Map.fetch!(grads, @scan_grad_names[key])
  end

  ## ------------------------------------------------------------------------------ SSD

  @doc """
  Mamba-2's chunked SSD scan (docs/ssd.md), target `xla_ssm_ssd_fwd`.

  `x`: `{batch, seqlen, heads, headdim}`, `dt`: `{batch, seqlen, heads}`, `b`, `c`: `{batch,
  seqlen, groups, dstate}` (one type: f32, bf16 or f16); `a`: `{heads}` f32.

  Options: `:chunk_size` (256; 32, 64, 128 or 256), `:d` (`{heads}` or `{heads, headdim}` f32),
  `:z` (like x), `:dt_bias` (`{heads}` f32), `:dt_softplus` (false), `:dt_limit` (`{0.0,
  :infinity}`: no clamp; use `:infinity` / `:neg_infinity` for open ends), `:initial_states`
  (`{batch, heads, headdim, dstate}` f32), `:return_final_states` (false), `:workspace` (true).

  Returns `y` (like x), or `{y, final_states}`. Differentiable inside `defn` (the gradient runs
  the forward again saving `chunk_states`, then `xla_ssm_ssd_bwd`).
  """
  def ssd(x, dt, a, b, c, opts \\ []) do
    opts =
      Keyword.validate!(opts, [
        :d,
        :z,
        :dt_bias,
        :initial_states,
        chunk_size: 256,
        dt_softplus: false,
        dt_limit: {0.0, :infinity},
        return_final_states: false,
        workspace: true
      ])

    named =
      present(
        x: x,
        dt: dt,
        a: a,
        b: b,
        c: c,
        d: opts[:d],
        z: opts[:z],
        dt_bias: opts[:dt_bias],
        initial_states: opts[:initial_states]
      )

    spec_opts = Keyword.take(opts, [:chunk_size, :dt_softplus, :dt_limit, :workspace])
    tag = %Block.SsdFwd{operands: Keyword.keys(named), opts: spec_opts}
    %{"y" => y, "final_states" => final_states} = Block.run(tag, Keyword.values(named))

    {y, final_states} =
      if traced?(y) do
        grad = &ssd_grads(named, spec_opts, opts[:return_final_states], {y, final_states}, &1)
        Nx.Defn.Kernel.custom_grad({y, final_states}, Keyword.values(named), grad)
      else
        {y, final_states}
      end

    if opts[:return_final_states], do: {y, final_states}, else: y
  end

  @ssd_grad_names %{
    x: "dx",
    dt: "ddt",
    a: "dA",
    b: "dB",
    c: "dC",
    d: "dD",
    z: "dz",
    dt_bias: "ddt_bias",
    initial_states: "dinitial_states"
  }

  defp ssd_grads(named, spec_opts, with_final, {y, final_states}, {g_y, g_final}) do
    keys = Keyword.keys(named)
    args = Keyword.values(named)
    fwd_opts = Keyword.put(spec_opts, :save_chunk_states, true)
    %{"chunk_states" => chunk_states} = Block.run(%Block.SsdFwd{operands: keys, opts: fwd_opts}, args)

    cotangents =
      [chunk_states: chunk_states, dy: like(g_y, y)] ++
        if(with_final, do: [dfinal_states: like(g_final, final_states)], else: [])

    tag = %Block.SsdBwd{operands: keys ++ Keyword.keys(cotangents), opts: spec_opts}
    grads = Block.run(tag, args ++ Keyword.values(cotangents))
    Enum.map(keys, &Map.fetch!(grads, @ssd_grad_names[&1]))
  end

  ## --------------------------------------------------------------------------- decode

  @doc """
  One decode token of the Mamba-1 selective scan (docs/decode.md), target
  `xla_ssm_selective_state_update`.

  `state`: `{batch, dim, dstate}` f32 or x's type (or `{slots, dim, dstate}` with
  `:state_batch_indices`, `{batch}` s32: row i updates slot i, negative entries are padding);
  `x`, `dt`: `{batch, dim}`; `a`: `{dim, dstate}` f32; `b`, `c`: `{batch, groups, dstate}`.
  Options: `:d`, `:dt_bias` (`{dim}` f32), `:z` (`{batch, dim}`), `:state_batch_indices`,
  `:dt_softplus` (false).

  Returns `{out, new_state}`. EXLA does not alias the state to the result, so the handler
  copies it first (correct, one copy per call).
  """
  def selective_state_update(state, x, dt, a, b, c, opts \\ []) do
    opts = Keyword.validate!(opts, [:d, :z, :dt_bias, :state_batch_indices, dt_softplus: false])

    named =
      present(
        state: state,
        x: x,
        dt: dt,
        a: a,
        b: b,
        c: c,
        d: opts[:d],
        z: opts[:z],
        dt_bias: opts[:dt_bias],
        state_batch_indices: opts[:state_batch_indices]
      )

    tag = %Block.SelectiveStateUpdate{operands: Keyword.keys(named), opts: Keyword.take(opts, [:dt_softplus])}
    %{"out" => out, "state" => new_state} = Block.run(tag, Keyword.values(named))
    {out, new_state}
  end

  @doc """
  Depthwise causal conv1d (docs/decode.md), targets `xla_ssm_causal_conv1d_fwd` / `_bwd`.

  `x`: `{batch, dim, seqlen}` ("bdl") or `{batch, seqlen, dim}` ("bld"); `weight`: `{dim,
  width}`, width 2..4, f32 or x's type. Options: `:bias` (`{dim}`, weight's type),
  `:initial_states` (`{batch, dim, width - 1}`, x's type: the inputs before x, oldest first),
  `:activation` (nil or `:silu`), `:layout` ("bdl"), `:return_final_states` (false: also return
  the conv state after x, `{batch, dim, width - 1}`, for `causal_conv1d_update/4`).

  Differentiable inside `defn` in x, weight, bias and initial_states.
  """
  def causal_conv1d(x, weight, opts \\ []) do
    opts =
      Keyword.validate!(opts, [:bias, :initial_states, activation: nil, layout: "bdl", return_final_states: false])

    named = present(x: x, weight: weight, bias: opts[:bias], initial_states: opts[:initial_states])
    spec_opts = [silu: silu?(opts[:activation]), layout: opts[:layout]]
    tag = %Block.CausalConv1dFwd{operands: Keyword.keys(named), opts: spec_opts}
    %{"out" => out} = Block.run(tag, Keyword.values(named))

    out =
      if traced?(out) do
        Nx.Defn.Kernel.custom_grad(out, Keyword.values(named), &conv_grads(named, spec_opts, out, &1))
      else
        out
      end

    if opts[:return_final_states], do: {out, conv_final_states(named, opts[:layout])}, else: out
  end

  defp conv_grads(named, spec_opts, out, g) do
    # dout joins the operands right after x and weight, before the optional ones.
    {[x, weight], optional} = Enum.split(named, 2)
    operands = [x, weight, {:dout, like(g, out)}] ++ optional
    tag = %Block.CausalConv1dBwd{operands: Keyword.keys(operands), opts: spec_opts}
    grads = Block.run(tag, Keyword.values(operands))
    names = %{x: "dx", weight: "dweight", bias: "dbias", initial_states: "dinitial_states"}
    Enum.map(Keyword.keys(named), &Map.fetch!(grads, names[&1]))
  end

  # The last width - 1 inputs (after initial_states, or zeros), as the conv state.
  defp conv_final_states(named, layout) do
    x = if layout in ["bld", :bld], do: Nx.transpose(named[:x], axes: [0, 2, 1]), else: named[:x]
    {batch, dim, seqlen} = Nx.shape(x)
    keep = Nx.axis_size(named[:weight], 1) - 1
    h0 = named[:initial_states] || Nx.broadcast(Nx.tensor(0, type: x.type), {batch, dim, keep})
    Nx.slice(Nx.concatenate([h0, x], axis: 2), [0, 0, seqlen], [batch, dim, keep])
  end

  @doc """
  Causal conv1d over new tokens from a conv state, target `xla_ssm_causal_conv1d_update`.

  `x`: `{batch, dim}` (one token) or rank 3 in `:layout`; `conv_state`: `{batch, dim, width -
  1}` (or `{slots, dim, width - 1}` with `:state_batch_indices`), x's type; `weight`: `{dim,
  width}`. Options: `:bias`, `:activation`, `:state_batch_indices`, `:layout`.
  Returns `{out, new_conv_state}`.
  """
  def causal_conv1d_update(x, conv_state, weight, opts \\ []) do
    opts = Keyword.validate!(opts, [:bias, :state_batch_indices, activation: nil, layout: "bdl"])

    named =
      present(
        x: x,
        conv_state: conv_state,
        weight: weight,
        bias: opts[:bias],
        state_batch_indices: opts[:state_batch_indices]
      )

    spec_opts = [silu: silu?(opts[:activation]), layout: opts[:layout]]
    tag = %Block.CausalConv1dUpdate{operands: Keyword.keys(named), opts: spec_opts}
    %{"out" => out, "conv_state" => new_state} = Block.run(tag, Keyword.values(named))
    {out, new_state}
  end

  @doc """
  One token through a Mamba layer's SSM part in one kernel, target `xla_ssm_mamba_decode_step`:
  `xc = silu(causal_conv1d_update(x, conv_state, conv_weight, conv_bias))`, then
  `selective_state_update(ssm_state, xc, dt, a, b, c, ...)`. Options: `:conv_bias`, `:d`, `:z`,
  `:dt_bias`, `:state_batch_indices`, `:dt_softplus`. Returns `{out, new_conv_state,
  new_ssm_state}`.
  """
  def mamba_decode_step(x, conv_state, conv_weight, ssm_state, dt, a, b, c, opts \\ []) do
    opts = Keyword.validate!(opts, [:conv_bias, :d, :z, :dt_bias, :state_batch_indices, dt_softplus: false])

    named =
      present(
        x: x,
        conv_state: conv_state,
        conv_weight: conv_weight,
        ssm_state: ssm_state,
        dt: dt,
        a: a,
        b: b,
        c: c,
        conv_bias: opts[:conv_bias],
        d: opts[:d],
        z: opts[:z],
        dt_bias: opts[:dt_bias],
        state_batch_indices: opts[:state_batch_indices]
      )

    tag = %Block.MambaDecodeStep{operands: Keyword.keys(named), opts: Keyword.take(opts, [:dt_softplus])}
    results = Block.run(tag, Keyword.values(named))
    {results["out"], results["conv_state"], results["ssm_state"]}
  end

  ## ---------------------------------------------------------------------------- helpers

  # The operands given, in ABI order, as tensors.
  defp present(pairs) do
    for {key, value} <- pairs, value != nil, do: {key, Nx.to_tensor(value)}
  end

  # Inside defn (or a gradient) tensors are expressions: only there is custom_grad meaningful.
  defp traced?(%Nx.Tensor{data: %Nx.Defn.Expr{}}), do: true
  defp traced?(_), do: false

  # A cotangent in its primal's shape and type: an unused output's arrives as a scalar zero.
  defp like(g, primal), do: g |> Nx.broadcast(primal.shape) |> Nx.as_type(primal.type)

  defp silu?(nil), do: false
  defp silu?(activation) when activation in [:silu, :swish, "silu", "swish"], do: true

  defp silu?(other),
    do: raise(ArgumentError, "activation must be nil, :silu or :swish, got #{inspect(other)}")
end
