defmodule XlaSsm.Spec do
  @moduledoc """
  The exact XLA custom calls of libxla_ssm, described in plain Elixir (no Nx, no EXLA).

  Each function takes the operands as a map (or keyword list) from name to a description,
  `{shape, type}` or anything with `:shape` and `:type` fields (an `Nx.Tensor` does), plus
  options; it checks the shapes and types as the library's handlers do and returns an
  `XlaSsm.Spec.Call`: the target name, the operands in ABI order, the results with their shapes
  and types (workspaces as `{:u, 8}` bytes), and the attributes as MLIR text
  (`XlaSsm.Spec.Attr`). A bad operand raises `ArgumentError` naming it.

  Types are Nx-style: `{:f, 32}`, `{:bf, 16}`, `{:f, 16}`, `{:s, 32}`, `{:u, 8}` (or the atoms
  `:f32`, `:bf16`, `:f16`, `:s32`, `:u8`). Operand keys are lower case (`:a` for `A`); the call
  names operands and results as the docs do (`"A"`, `"dB"`, ...).

  The ABI is the one of `docs/*.md`; operand order, optional operands and attribute names follow
  the JAX binding (`bindings/python/xla_ssm/`), which calls the same targets.

  ## Workspace

  The CUDA targets of the selective scan and SSD take scratch as a last `workspace` result
  (the backward ones fail without it); the CPU targets ignore it. The platform is unknown while
  a computation is traced, so by default (`workspace: true`) the call carries it whenever its
  size is not 0. Pass `workspace: false` to leave it out (CPU only, or a forward scan that may
  run unsplit). The other targets take no workspace.
  """

  alias XlaSsm.Spec.{Attr, Call, Workspace}

  @max_dstate 256
  @chunk_sizes [32, 64, 128, 256]
  @floats [{:f, 32}, {:bf, 16}, {:f, 16}]
  @f32 {:f, 32}

  defmodule Call do
    @moduledoc """
    One custom call: `target` (the XLA target name), `operands` and `results` as
    `{name, shape, type}` in ABI order, `attributes` as `{name, mlir_text}`, and
    `workspace_bytes`: the workspace the CUDA target needs for these shapes (the library's
    `xla_ssm_*_workspace_bytes`; 0 for targets without one). The `workspace` result, when
    present, is last and that long.
    """
    @enforce_keys [:target, :operands, :results, :attributes]
    defstruct [:target, :operands, :results, :attributes, workspace_bytes: 0]

    @type entry :: {String.t(), tuple, {atom, pos_integer}}
    @type t :: %__MODULE__{
            target: String.t(),
            operands: [entry],
            results: [entry],
            attributes: [{String.t(), String.t()}],
            workspace_bytes: non_neg_integer
          }
  end

  @doc "Every target this module describes, by function name."
  @spec targets() :: [atom]
  def targets do
    [
      :selective_scan_fwd,
      :selective_scan_bwd,
      :ssd_fwd,
      :ssd_bwd,
      :selective_state_update,
      :causal_conv1d_fwd,
      :causal_conv1d_bwd,
      :causal_conv1d_update,
      :mamba_decode_step
    ]
  end

  ## ------------------------------------------------------------------ selective scan

  @doc """
  `xla_ssm_selective_scan_fwd` (docs/selective_scan_fwd.md).

  Operands: `:u`, `:delta` (T = f32, bf16 or f16; `(batch, dim, seqlen)`, or `(batch, seqlen,
  dim)` with layout "bld"), `:a` `(dim, dstate)` f32, `:b`, `:c` (time-varying, rank 4, or
  `(dim, dstate)`; f32 or T), optional `:d`, `:z`, `:delta_bias`, `:initial_state`,
  `:cu_seqlens`.

  Packed sequences (docs/selective_scan_fwd.md, "Packed sequences"): `:cu_seqlens` `{num_seqs +
  1}` s32 holds the boundaries of `num_seqs` sequences laid one after another along seqlen of a
  batch-1 input; `initial_state` and `final_state` are then `(num_seqs, dim, dstate)`, and the
  call carries `has_cu_seqlens = true` (a call without it carries no such attribute). Only the
  shapes are checked here; the values (0 first, non-decreasing, seqlen last) are the caller's
  (the CPU target refuses bad ones, the CUDA target cannot see them).

  Options: `:delta_softplus` (false), `:layout` ("bdl"), `:checkpoint_len` (0: no checkpoints;
  else a positive multiple of 32, adding the `checkpoints` result), `:workspace` (true).

  Results: `out`, `final_state`, [`checkpoints`], [`workspace`].
  """
  @spec selective_scan_fwd(map | keyword, keyword) :: Call.t()
  def selective_scan_fwd(operands, opts \\ []) do
    op = "selective_scan_fwd"

    opts =
      validate_opts!(op, opts, delta_softplus: false, layout: "bdl", checkpoint_len: 0, workspace: true)

    ops = operands!(op, operands, [:u, :delta, :a, :b, :c], [:d, :z, :delta_bias, :initial_state, :cu_seqlens])
    s = check_scan_inputs!(op, ops, opts)
    ck = opts[:checkpoint_len]
    check_checkpoint_len!(op, ck, true)

    results =
      [{"out", s.u_shape, s.t}, {"final_state", s.state_shape, @f32}] ++
        if(ck > 0, do: [{"checkpoints", {s.batch, s.dim, n_checkpoints(s.seqlen, ck), s.dstate}, @f32}], else: [])

    attrs =
      scan_attrs(opts, s.present) ++
        packed_attrs(s) ++ if(ck > 0, do: [{"checkpoint_len", Attr.i64(ck)}], else: [])

    ws = Workspace.selective_scan_fwd_bytes(s.batch, s.dim, s.seqlen, s.dstate)
    build("xla_ssm_selective_scan_fwd", s.operands ++ s.cu_seqlens, results, attrs, ws, opts[:workspace])
  end

  @doc """
  `xla_ssm_selective_scan_bwd` (docs/selective_scan_bwd.md).

  Operands: the forward's, then `:checkpoints` (from a forward with the same `checkpoint_len`),
  `:dout` (like u) and optional `:dfinal_state` `(batch, dim, dstate)` f32 (`(num_seqs, dim,
  dstate)` with `:cu_seqlens`, which gets no gradient).

  Options: `:delta_softplus`, `:layout`, `:checkpoint_len` (required: a positive multiple of 32),
  `:workspace` (true).

  Results: `du`, `ddelta`, `dA`, `dB`, `dC`, then `dD`, `dz`, `ddelta_bias`, `dinitial_state`
  for the optional operands given, [`workspace`].
  """
  @spec selective_scan_bwd(map | keyword, keyword) :: Call.t()
  def selective_scan_bwd(operands, opts) do
    op = "selective_scan_bwd"

    opts =
      validate_opts!(op, opts, delta_softplus: false, layout: "bdl", checkpoint_len: nil, workspace: true)

    ops =
      operands!(
        op,
        operands,
        [:u, :delta, :a, :b, :c, :checkpoints, :dout],
        [:d, :z, :delta_bias, :initial_state, :cu_seqlens, :dfinal_state]
      )

    s = check_scan_inputs!(op, ops, opts)
    ck = opts[:checkpoint_len]
    check_checkpoint_len!(op, ck, false)
    ck_shape = {s.batch, s.dim, n_checkpoints(s.seqlen, ck), s.dstate}
    checkpoints = expect!(op, ops, :checkpoints, "checkpoints", ck_shape, [@f32], "(batch, dim, n_checkpoints, dstate)")
    dout = expect!(op, ops, :dout, "dout", s.u_shape, [s.t], "(like u)")

    {dfinal, has_dfinal} =
      optional(ops, :dfinal_state, fn ->
        expect!(op, ops, :dfinal_state, "dfinal_state", s.state_shape, [@f32], s.state_meaning)
      end)

    operands = s.operands ++ s.cu_seqlens ++ [checkpoints, dout] ++ dfinal
    # Gradients have their primal's shape and type; the boundaries have none.
    grad_names = ~w(du ddelta dA dB dC) ++ present_names(s.present, ~w(dD dz ddelta_bias dinitial_state))
    results = Enum.zip_with(grad_names, s.operands, fn name, {_, shape, type} -> {name, shape, type} end)

    attrs =
      scan_attrs(opts, s.present) ++
        packed_attrs(s) ++ [{"checkpoint_len", Attr.i64(ck)}, {"has_dfinal_state", Attr.bool(has_dfinal)}]

    groups = if s.time_varying, do: s.groups, else: 0
    ws = Workspace.selective_scan_bwd_bytes(s.batch, s.dim, s.seqlen, s.dstate, groups)
    build("xla_ssm_selective_scan_bwd", operands, results, attrs, ws, opts[:workspace])
  end

  defp scan_attrs(opts, present) do
    [
      {"delta_softplus", Attr.bool(opts[:delta_softplus])},
      {"has_d", Attr.bool(present.d)},
      {"has_z", Attr.bool(present.z)},
      {"has_delta_bias", Attr.bool(present.delta_bias)},
      {"has_initial_state", Attr.bool(present.initial_state)},
      {"layout", Attr.string(opts[:layout])}
    ]
  end

  # Only packed calls carry the attribute: the calls without it stay those of older libraries.
  defp packed_attrs(%{cu_seqlens: []}), do: []
  defp packed_attrs(_s), do: [{"has_cu_seqlens", Attr.bool(true)}]

  defp check_checkpoint_len!(op, ck, allow_zero) do
    ok = is_integer(ck) and ((allow_zero and ck == 0) or (ck > 0 and rem(ck, 32) == 0))

    unless ok do
      zero = if allow_zero, do: "0 (none) or ", else: ""

      raise ArgumentError,
            "#{op}: option :checkpoint_len must be #{zero}a positive multiple of 32, got #{inspect(ck)}"
    end
  end

  @doc "Checkpoints of a sequence: `ceil(seqlen / checkpoint_len)` (0 without checkpoints)."
  @spec n_checkpoints(non_neg_integer, non_neg_integer) :: non_neg_integer
  def n_checkpoints(_seqlen, ck) when ck <= 0, do: 0
  def n_checkpoints(seqlen, ck), do: div(seqlen + ck - 1, ck)

  # The inputs both scan passes share; returns the sizes and the operand entries.
  defp check_scan_inputs!(op, ops, opts) do
    layout = layout!(op, opts[:layout])
    bool!(op, :delta_softplus, opts[:delta_softplus])
    meaning = if layout == "bdl", do: "(batch, dim, seqlen)", else: "(batch, seqlen, dim)"

    {u_shape, t} = desc(ops, :u)
    rank!(op, "u", u_shape, 3, meaning)
    type!(op, "u", t, @floats)

    {batch, dim, seqlen} =
      case {layout, u_shape} do
        {"bdl", {b, d, l}} -> {b, d, l}
        {"bld", {b, l, d}} -> {b, d, l}
      end

    u = {"u", u_shape, t}
    delta = expect!(op, ops, :delta, "delta", u_shape, [t], "(like u)")

    {a_shape, _} = desc(ops, :a)

    unless tuple_size(a_shape) == 2 and elem(a_shape, 0) == dim do
      raise ArgumentError, "#{op}: operand `A` must have shape (dim = #{dim}, dstate), got #{fmt(a_shape)}"
    end

    dstate = elem(a_shape, 1)

    unless dstate <= @max_dstate do
      raise ArgumentError, "#{op}: dstate (A's second axis) must be at most #{@max_dstate}, got #{dstate}"
    end

    a = expect!(op, ops, :a, "A", {dim, dstate}, [@f32], "(dim, dstate)")

    {b_shape, b_type} = desc(ops, :b)
    type!(op, "B", b_type, Enum.uniq([@f32, t]))

    {time_varying, groups} =
      case tuple_size(b_shape) do
        2 ->
          unless b_shape == {dim, dstate} do
            raise ArgumentError,
                  "#{op}: operand `B` (time-invariant, rank 2) must have shape (dim, dstate) = #{fmt({dim, dstate})}, got #{fmt(b_shape)}"
          end

          {false, 1}

        4 ->
          {groups, want, form} =
            if layout == "bdl" do
              g = elem(b_shape, 1)
              {g, {batch, g, dstate, seqlen}, "(batch, groups, dstate, seqlen)"}
            else
              g = elem(b_shape, 2)
              {g, {batch, seqlen, g, dstate}, "(batch, seqlen, groups, dstate)"}
            end

          unless b_shape == want do
            raise ArgumentError, "#{op}: operand `B` must have shape #{form} = #{fmt(want)}, got #{fmt(b_shape)}"
          end

          unless groups >= 1 and rem(dim, groups) == 0 do
            raise ArgumentError, "#{op}: operand `B`: groups (#{groups}) must be at least 1 and divide dim (#{dim})"
          end

          {true, groups}

        _ ->
          raise ArgumentError,
                "#{op}: operand `B` must have rank 2 (dim, dstate) or rank 4 (time-varying), got shape #{fmt(b_shape)}"
      end

    b = {"B", b_shape, b_type}
    c = expect!(op, ops, :c, "C", b_shape, [b_type], "(like B)")

    {d, has_d} = optional(ops, :d, fn -> expect!(op, ops, :d, "D", {dim}, [@f32], "(dim)") end)
    {z, has_z} = optional(ops, :z, fn -> expect!(op, ops, :z, "z", u_shape, [t], "(like u)") end)

    {bias, has_bias} =
      optional(ops, :delta_bias, fn -> expect!(op, ops, :delta_bias, "delta_bias", {dim}, [@f32], "(dim)") end)

    # The library's order: the boundaries before the states they size.
    {cu, _} = optional(ops, :cu_seqlens, fn -> cu_seqlens!(op, ops, batch) end)

    {state_rows, state_meaning} =
      case cu do
        [] -> {batch, "(batch, dim, dstate)"}
        [{_, {n}, _}] -> {n - 1, "(num_seqs, dim, dstate) (packed sequences)"}
      end

    state_shape = {state_rows, dim, dstate}

    {h0, has_h0} =
      optional(ops, :initial_state, fn ->
        expect!(op, ops, :initial_state, "initial_state", state_shape, [@f32], state_meaning)
      end)

    %{
      batch: batch,
      dim: dim,
      seqlen: seqlen,
      dstate: dstate,
      groups: groups,
      time_varying: time_varying,
      t: t,
      u_shape: u_shape,
      state_shape: state_shape,
      state_meaning: state_meaning,
      # The differentiable operands; `cu_seqlens` follows them in a call.
      operands: [u, delta, a, b, c] ++ d ++ z ++ bias ++ h0,
      cu_seqlens: cu,
      present: %{d: has_d, z: has_z, delta_bias: has_bias, initial_state: has_h0}
    }
  end

  # `cu_seqlens` of a packed call: s32 `{num_seqs + 1}` along seqlen of a batch-1 input.
  defp cu_seqlens!(op, ops, batch) do
    {shape, type} = desc(ops, :cu_seqlens)
    rank!(op, "cu_seqlens", shape, 1, "(num_seqs + 1) [boundaries]")
    type!(op, "cu_seqlens", type, [{:s, 32}])

    unless elem(shape, 0) >= 1 do
      raise ArgumentError,
            "#{op}: operand `cu_seqlens` must have shape (num_seqs + 1) with at least one boundary, got #{fmt(shape)}"
    end

    unless batch == 1 do
      raise ArgumentError,
            "#{op}: operand `cu_seqlens`: packed sequences lie along seqlen of one batch row: u's batch must be 1, got #{batch}"
    end

    {"cu_seqlens", shape, type}
  end

  ## ------------------------------------------------------------------------------ SSD

  @doc """
  `xla_ssm_ssd_fwd` (docs/ssd.md).

  Operands: `:x` `(batch, seqlen, heads, headdim)`, `:dt` `(batch, seqlen, heads)`, `:b`, `:c`
  `(batch, seqlen, groups, dstate)` (all of one type T: f32, bf16 or f16), `:a` `(heads)` f32,
  optional `:d` (`(heads)` or `(heads, headdim)` f32), `:z` (like x), `:dt_bias` `(heads)` f32,
  `:initial_states` `(batch, heads, headdim, dstate)` f32.

  Options: `:chunk_size` (256; 32, 64, 128 or 256), `:dt_softplus` (false), `:dt_limit`
  (`{0.0, :infinity}`, see `effective_dt_limit/1`), `:save_chunk_states` (false), `:workspace`
  (true).

  Results: `y`, `final_states`, [`chunk_states`, of the type `ssd_chunk_states_type/4` names],
  [`workspace`].
  """
  @spec ssd_fwd(map | keyword, keyword) :: Call.t()
  def ssd_fwd(operands, opts \\ []) do
    op = "ssd_fwd"

    opts =
      validate_opts!(op, opts,
        chunk_size: 256,
        dt_softplus: false,
        dt_limit: {0.0, :infinity},
        save_chunk_states: false,
        workspace: true
      )

    bool!(op, :save_chunk_states, opts[:save_chunk_states])
    ops = operands!(op, operands, [:x, :dt, :a, :b, :c], [:d, :z, :dt_bias, :initial_states])
    s = check_ssd_inputs!(op, ops, opts)
    save = opts[:save_chunk_states]

    results =
      [{"y", s.x_shape, s.t}, {"final_states", s.state_shape, @f32}] ++
        if(save, do: [{"chunk_states", s.chunk_shape, s.chunk_type}], else: [])

    attrs = ssd_attrs(s) ++ [{"save_chunk_states", Attr.bool(save)}]
    ws = Workspace.ssd_fwd_bytes(s.batch, s.seqlen, s.heads, s.headdim, s.dstate, s.groups, s.chunk_size, s.t)
    build("xla_ssm_ssd_fwd", s.operands, results, attrs, ws, opts[:workspace])
  end

  @doc """
  `xla_ssm_ssd_bwd` (docs/ssd.md).

  Operands: the forward's, then `:chunk_states` (from the forward: same chunk size and type),
  `:dy` (like x) and optional `:dfinal_states` `(batch, heads, headdim, dstate)` f32.
  Options: the forward's, without `:save_chunk_states`.

  Results: `dx`, `ddt`, `dA`, `dB`, `dC`, then `dD`, `dz`, `ddt_bias`, `dinitial_states` for the
  optional operands given, [`workspace`].
  """
  @spec ssd_bwd(map | keyword, keyword) :: Call.t()
  def ssd_bwd(operands, opts \\ []) do
    op = "ssd_bwd"

    opts =
      validate_opts!(op, opts, chunk_size: 256, dt_softplus: false, dt_limit: {0.0, :infinity}, workspace: true)

    ops =
      operands!(
        op,
        operands,
        [:x, :dt, :a, :b, :c, :chunk_states, :dy],
        [:d, :z, :dt_bias, :initial_states, :dfinal_states]
      )

    s = check_ssd_inputs!(op, ops, opts)

    chunk_states =
      expect!(
        op,
        ops,
        :chunk_states,
        "chunk_states",
        s.chunk_shape,
        [s.chunk_type],
        "(batch, heads, headdim, n_chunks, dstate)"
      )

    dy = expect!(op, ops, :dy, "dy", s.x_shape, [s.t], "(like x)")

    {dfinal, has_dfinal} =
      optional(ops, :dfinal_states, fn ->
        expect!(op, ops, :dfinal_states, "dfinal_states", s.state_shape, [@f32], "(batch, heads, headdim, dstate)")
      end)

    operands = s.operands ++ [chunk_states, dy] ++ dfinal
    grad_names = ~w(dx ddt dA dB dC) ++ present_names(s.present, ~w(dD dz ddt_bias dinitial_states))
    results = Enum.zip_with(grad_names, s.operands, fn name, {_, shape, type} -> {name, shape, type} end)
    attrs = ssd_attrs(s) ++ [{"has_dfinal_states", Attr.bool(has_dfinal)}]
    ws = Workspace.ssd_bwd_bytes(s.batch, s.seqlen, s.heads, s.headdim, s.dstate, s.groups, s.chunk_size, s.t)
    build("xla_ssm_ssd_bwd", operands, results, attrs, ws, opts[:workspace])
  end

  @doc """
  The clamp the SSD targets apply for a user's `dt_limit`: Mamba's default `{0.0, :infinity}`
  means no clamp, which the targets (which always clamp) spell `{:neg_infinity, :infinity}`.
  Any other pair is kept.
  """
  @spec effective_dt_limit({number | :neg_infinity, number | :infinity}) :: {term, term}
  def effective_dt_limit({lo, :infinity}) when lo == 0, do: {:neg_infinity, :infinity}
  def effective_dt_limit(limit), do: limit

  @doc "The `chunk_states` type of an SSD call (`xla_ssm_ssd_chunk_states_dtype`)."
  defdelegate ssd_chunk_states_type(headdim, dstate, chunk_size, type), to: Workspace

  defp ssd_attrs(s) do
    {dt_min, dt_max} = s.dt_limit

    [
      {"chunk_size", Attr.i64(s.chunk_size)},
      {"has_d", Attr.bool(s.present.d)},
      {"has_z", Attr.bool(s.present.z)},
      {"has_dt_bias", Attr.bool(s.present.dt_bias)},
      {"has_initial_states", Attr.bool(s.present.initial_states)},
      {"dt_softplus", Attr.bool(s.dt_softplus)},
      {"dt_min", Attr.f32(dt_min)},
      {"dt_max", Attr.f32(dt_max)}
    ]
  end

  defp check_ssd_inputs!(op, ops, opts) do
    chunk_size = opts[:chunk_size]

    unless chunk_size in @chunk_sizes do
      raise ArgumentError,
            "#{op}: option :chunk_size must be one of #{inspect(@chunk_sizes)}, got #{inspect(chunk_size)}"
    end

    bool!(op, :dt_softplus, opts[:dt_softplus])
    dt_limit = dt_limit!(op, opts[:dt_limit])

    {x_shape, t} = desc(ops, :x)
    rank!(op, "x", x_shape, 4, "(batch, seqlen, heads, headdim)")
    type!(op, "x", t, @floats)
    {batch, seqlen, heads, headdim} = x_shape
    x = {"x", x_shape, t}
    dt = expect!(op, ops, :dt, "dt", {batch, seqlen, heads}, [t], "(batch, seqlen, heads)")
    a = expect!(op, ops, :a, "A", {heads}, [@f32], "(heads)")

    {b_shape, _} = desc(ops, :b)

    unless tuple_size(b_shape) == 4 and elem(b_shape, 0) == batch and elem(b_shape, 1) == seqlen do
      raise ArgumentError,
            "#{op}: operand `B` must have shape (batch, seqlen, groups, dstate) = (#{batch}, #{seqlen}, ., .), got #{fmt(b_shape)}"
    end

    {_, _, groups, dstate} = b_shape

    unless groups >= 1 and rem(heads, groups) == 0 do
      raise ArgumentError, "#{op}: operand `B`: groups (#{groups}) must be at least 1 and divide heads (#{heads})"
    end

    unless dstate >= 1 and dstate <= @max_dstate do
      raise ArgumentError, "#{op}: operand `B`: dstate must be in [1, #{@max_dstate}], got #{dstate}"
    end

    b = expect!(op, ops, :b, "B", b_shape, [t], "(batch, seqlen, groups, dstate)")
    c = expect!(op, ops, :c, "C", b_shape, [t], "(like B)")

    {d, has_d} =
      optional(ops, :d, fn ->
        {d_shape, _} = desc(ops, :d)

        unless d_shape in [{heads}, {heads, headdim}] do
          raise ArgumentError,
                "#{op}: operand `D` must have shape (heads) = #{fmt({heads})} or (heads, headdim) = #{fmt({heads, headdim})}, got #{fmt(d_shape)}"
        end

        expect!(op, ops, :d, "D", d_shape, [@f32], "(heads) or (heads, headdim)")
      end)

    {z, has_z} = optional(ops, :z, fn -> expect!(op, ops, :z, "z", x_shape, [t], "(like x)") end)

    {bias, has_bias} =
      optional(ops, :dt_bias, fn -> expect!(op, ops, :dt_bias, "dt_bias", {heads}, [@f32], "(heads)") end)

    state_shape = {batch, heads, headdim, dstate}

    {h0, has_h0} =
      optional(ops, :initial_states, fn ->
        expect!(op, ops, :initial_states, "initial_states", state_shape, [@f32], "(batch, heads, headdim, dstate)")
      end)

    %{
      batch: batch,
      seqlen: seqlen,
      heads: heads,
      headdim: headdim,
      dstate: dstate,
      groups: groups,
      chunk_size: chunk_size,
      dt_softplus: opts[:dt_softplus],
      dt_limit: dt_limit,
      t: t,
      x_shape: x_shape,
      state_shape: state_shape,
      chunk_shape: {batch, heads, headdim, div(seqlen + chunk_size - 1, chunk_size), dstate},
      chunk_type: Workspace.ssd_chunk_states_type(headdim, dstate, chunk_size, t),
      operands: [x, dt, a, b, c] ++ d ++ z ++ bias ++ h0,
      present: %{d: has_d, z: has_z, dt_bias: has_bias, initial_states: has_h0}
    }
  end

  # The targets refuse NaN, dt_min > dt_max, dt_min = +inf and dt_max = -inf.
  defp dt_limit!(op, {lo, hi} = limit) do
    valid? = fn v -> is_number(v) or v in [:infinity, :neg_infinity] end

    rank = fn
      :neg_infinity -> {0, 0}
      :infinity -> {2, 0}
      v -> {1, v}
    end

    unless valid?.(lo) and valid?.(hi) and lo != :infinity and hi != :neg_infinity and rank.(lo) <= rank.(hi) do
      raise ArgumentError,
            "#{op}: option :dt_limit must be {dt_min, dt_max} with dt_min <= dt_max (numbers, :neg_infinity, :infinity; dt_min < :infinity, dt_max > :neg_infinity), got #{inspect(limit)}"
    end

    effective_dt_limit(limit)
  end

  defp dt_limit!(op, other),
    do: raise(ArgumentError, "#{op}: option :dt_limit must be a {dt_min, dt_max} tuple, got #{inspect(other)}")

  ## --------------------------------------------------------------------------- decode

  @doc """
  `xla_ssm_selective_state_update` (docs/decode.md): one decode token.

  Operands: `:state` (`(batch, dim, dstate)`, or `(slots, dim, dstate)` with
  `:state_batch_indices`; f32 or T), `:x`, `:dt` `(batch, dim)` T, `:a` `(dim, dstate)` f32,
  `:b`, `:c` `(batch, groups, dstate)` f32 or T, optional `:d`, `:dt_bias` `(dim)` f32, `:z`
  `(batch, dim)` T, `:state_batch_indices` `(batch)` s32. Options: `:dt_softplus` (false).

  Results: `out` `(batch, dim)` T and `state` (the new state; EXLA does not alias it to the
  operand, so the handler copies the state first).
  """
  @spec selective_state_update(map | keyword, keyword) :: Call.t()
  def selective_state_update(operands, opts \\ []) do
    op = "selective_state_update"
    opts = validate_opts!(op, opts, dt_softplus: false)
    bool!(op, :dt_softplus, opts[:dt_softplus])
    ops = operands!(op, operands, [:state, :x, :dt, :a, :b, :c], [:d, :z, :dt_bias, :state_batch_indices])
    s = check_update_inputs!(op, ops)

    attrs = [
      {"dt_softplus", Attr.bool(opts[:dt_softplus])},
      {"has_d", Attr.bool(s.present.d)},
      {"has_z", Attr.bool(s.present.z)},
      {"has_dt_bias", Attr.bool(s.present.dt_bias)},
      {"has_state_batch_indices", Attr.bool(s.present.state_batch_indices)}
    ]

    {_, state_shape, state_type} = s.state
    results = [{"out", {s.batch, s.dim}, s.t}, {"state", state_shape, state_type}]
    build("xla_ssm_selective_state_update", [s.state | s.operands] ++ s.optional, results, attrs, 0, false)
  end

  # state, x, dt, A, B, C[, D][, z][, dt_bias][, state_batch_indices] (shared with the fused step).
  defp check_update_inputs!(op, ops, state_key \\ :state, state_name \\ "state") do
    {x_shape, t} = desc(ops, :x)
    rank!(op, "x", x_shape, 2, "(batch, dim)")
    type!(op, "x", t, @floats)
    {batch, dim} = x_shape
    x = {"x", x_shape, t}
    dt = expect!(op, ops, :dt, "dt", x_shape, [t], "(like x)")

    {a_shape, _} = desc(ops, :a)

    unless tuple_size(a_shape) == 2 and elem(a_shape, 0) == dim do
      raise ArgumentError, "#{op}: operand `A` must have shape (dim = #{dim}, dstate), got #{fmt(a_shape)}"
    end

    dstate = elem(a_shape, 1)

    unless dstate <= @max_dstate do
      raise ArgumentError, "#{op}: dstate (A's second axis) must be at most #{@max_dstate}, got #{dstate}"
    end

    a = expect!(op, ops, :a, "A", a_shape, [@f32], "(dim, dstate)")
    {b_shape, b_type} = desc(ops, :b)

    unless tuple_size(b_shape) == 3 and elem(b_shape, 0) == batch and elem(b_shape, 2) == dstate do
      raise ArgumentError,
            "#{op}: operand `B` must have shape (batch, groups, dstate) = (#{batch}, ., #{dstate}), got #{fmt(b_shape)}"
    end

    groups = elem(b_shape, 1)

    unless groups >= 1 and rem(dim, groups) == 0 do
      raise ArgumentError, "#{op}: operand `B`: groups (#{groups}) must be at least 1 and divide dim (#{dim})"
    end

    f32_or_t = Enum.uniq([@f32, t])
    type!(op, "B", b_type, f32_or_t)
    b = {"B", b_shape, b_type}
    c = expect!(op, ops, :c, "C", b_shape, [b_type], "(like B)")
    {d, has_d} = optional(ops, :d, fn -> expect!(op, ops, :d, "D", {dim}, [@f32], "(dim)") end)
    {z, has_z} = optional(ops, :z, fn -> expect!(op, ops, :z, "z", x_shape, [t], "(like x)") end)
    {bias, has_bias} = optional(ops, :dt_bias, fn -> expect!(op, ops, :dt_bias, "dt_bias", {dim}, [@f32], "(dim)") end)

    {ix, has_ix} =
      optional(ops, :state_batch_indices, fn ->
        expect!(op, ops, :state_batch_indices, "state_batch_indices", {batch}, [{:s, 32}], "(batch)")
      end)

    {state_shape, _} = desc(ops, state_key)

    slots =
      if has_ix do
        rank!(op, state_name, state_shape, 3, "(slots, dim, dstate)")
        elem(state_shape, 0)
      else
        batch
      end

    state = expect!(op, ops, state_key, state_name, {slots, dim, dstate}, f32_or_t, "(slots or batch, dim, dstate)")

    %{
      batch: batch,
      dim: dim,
      dstate: dstate,
      slots: slots,
      t: t,
      state: state,
      operands: [x, dt, a, b, c],
      optional: d ++ z ++ bias ++ ix,
      present: %{d: has_d, z: has_z, dt_bias: has_bias, state_batch_indices: has_ix}
    }
  end

  @doc """
  `xla_ssm_causal_conv1d_fwd` (docs/decode.md): depthwise causal conv1d.

  Operands: `:x` (`(batch, dim, seqlen)`, or `(batch, seqlen, dim)` with layout "bld"; T),
  `:weight` `(dim, width)` (width 2..4; f32 or T), optional `:bias` `(dim)` (weight's type),
  `:initial_states` `(batch, dim, width - 1)` T, `:cu_seqlens` `(num_seqs + 1)` s32 (packed
  sequences along seqlen of a batch-1 x; initial_states is then `(num_seqs, dim, width - 1)`).
  Options: `:silu` (false), `:layout` ("bdl").

  Result: `out` (like x).
  """
  @spec causal_conv1d_fwd(map | keyword, keyword) :: Call.t()
  def causal_conv1d_fwd(operands, opts \\ []) do
    op = "causal_conv1d_fwd"
    opts = validate_opts!(op, opts, silu: false, layout: "bdl")
    ops = operands!(op, operands, [:x, :weight], [:bias, :initial_states, :cu_seqlens])
    s = check_conv_inputs!(op, ops, opts, [3])
    {cu, rows} = conv_cu_seqlens(op, ops, s)
    {h0, has_h0} = conv_initial_states(op, ops, s, rows)
    operands = [s.x, s.weight] ++ s.bias ++ h0 ++ cu
    attrs = conv_attrs(opts, s.has_bias) ++ [{"has_initial_states", Attr.bool(has_h0)}] ++ packed_attrs(%{cu_seqlens: cu})
    build("xla_ssm_causal_conv1d_fwd", operands, [{"out", s.x_shape, s.t}], attrs, 0, false)
  end

  @doc """
  `xla_ssm_causal_conv1d_bwd`: operands `:x`, `:weight`, `:dout` (like x), optional `:bias`,
  `:initial_states`, `:cu_seqlens`; options as the forward's. Results: `dx`, `dweight`, [`dbias`],
  [`dinitial_states`].
  """
  @spec causal_conv1d_bwd(map | keyword, keyword) :: Call.t()
  def causal_conv1d_bwd(operands, opts \\ []) do
    op = "causal_conv1d_bwd"
    opts = validate_opts!(op, opts, silu: false, layout: "bdl")
    ops = operands!(op, operands, [:x, :weight, :dout], [:bias, :initial_states, :cu_seqlens])
    s = check_conv_inputs!(op, ops, opts, [3])
    dout = expect!(op, ops, :dout, "dout", s.x_shape, [s.t], "(like x)")
    {cu, rows} = conv_cu_seqlens(op, ops, s)
    {h0, has_h0} = conv_initial_states(op, ops, s, rows)
    operands = [s.x, s.weight, dout] ++ s.bias ++ h0 ++ cu
    results = Enum.map([s.x, s.weight] ++ s.bias ++ h0, fn {name, shape, type} -> {"d" <> name, shape, type} end)
    attrs = conv_attrs(opts, s.has_bias) ++ [{"has_initial_states", Attr.bool(has_h0)}] ++ packed_attrs(%{cu_seqlens: cu})
    build("xla_ssm_causal_conv1d_bwd", operands, results, attrs, 0, false)
  end

  @doc """
  `xla_ssm_causal_conv1d_update`: new tokens through a conv state. Operands `:x` (`(batch, dim)`
  or rank 3 in the layout), `:conv_state` (`(batch, dim, width - 1)`, or `(slots, dim, width -
  1)` with `:state_batch_indices`; T), `:weight`, optional `:bias`, `:state_batch_indices`
  `(batch)` s32. Options: `:silu`, `:layout`. Results: `out` (like x), `conv_state` (the new
  state; EXLA does not alias it, so the handler copies first).
  """
  @spec causal_conv1d_update(map | keyword, keyword) :: Call.t()
  def causal_conv1d_update(operands, opts \\ []) do
    op = "causal_conv1d_update"
    opts = validate_opts!(op, opts, silu: false, layout: "bdl")
    ops = operands!(op, operands, [:x, :conv_state, :weight], [:bias, :state_batch_indices])
    s = check_conv_inputs!(op, ops, opts, [2, 3])

    {ix, has_ix} =
      optional(ops, :state_batch_indices, fn ->
        expect!(op, ops, :state_batch_indices, "state_batch_indices", {s.batch}, [{:s, 32}], "(batch)")
      end)

    state = conv_state!(op, ops, :conv_state, "conv_state", s, has_ix)
    operands = [s.x, state, s.weight] ++ s.bias ++ ix
    attrs = conv_attrs(opts, s.has_bias) ++ [{"has_state_batch_indices", Attr.bool(has_ix)}]
    {_, state_shape, _} = state
    results = [{"out", s.x_shape, s.t}, {"conv_state", state_shape, s.t}]
    build("xla_ssm_causal_conv1d_update", operands, results, attrs, 0, false)
  end

  defp conv_attrs(opts, has_bias) do
    [
      {"silu", Attr.bool(opts[:silu])},
      {"layout", Attr.string(opts[:layout])},
      {"has_bias", Attr.bool(has_bias)}
    ]
  end

  # `names` says what the weight and bias operands are called (the fused step prefixes "conv_").
  defp check_conv_inputs!(op, ops, opts, ranks, names \\ %{weight: "weight", bias: "bias"}) do
    layout = layout!(op, opts[:layout])
    bool!(op, :silu, opts[:silu])
    {x_shape, t} = desc(ops, :x)

    unless tuple_size(x_shape) in ranks do
      want = if ranks == [3], do: "rank 3", else: "rank 2 (batch, dim) or rank 3"
      form = if layout == "bdl", do: "(batch, dim, seqlen)", else: "(batch, seqlen, dim)"
      raise ArgumentError, "#{op}: operand `x` must have #{want} #{form}, got shape #{fmt(x_shape)}"
    end

    type!(op, "x", t, @floats)

    {batch, dim} =
      case {layout, x_shape} do
        {_, {b, d}} -> {b, d}
        {"bdl", {b, d, _}} -> {b, d}
        {"bld", {b, _, d}} -> {b, d}
      end

    {w_shape, w_type} = desc(ops, :weight)

    unless tuple_size(w_shape) == 2 and elem(w_shape, 0) == dim and elem(w_shape, 1) in 2..4 do
      raise ArgumentError,
            "#{op}: operand `#{names.weight}` must have shape (dim = #{dim}, width) with width in 2..4, got #{fmt(w_shape)}"
    end

    type!(op, names.weight, w_type, Enum.uniq([@f32, t]))

    {bias, has_bias} =
      optional(ops, :bias, fn ->
        expect!(op, ops, :bias, names.bias, {dim}, [w_type], "(dim)")
      end)

    %{
      batch: batch,
      dim: dim,
      width: elem(w_shape, 1),
      t: t,
      x_shape: x_shape,
      x: {"x", x_shape, t},
      weight: {names.weight, w_shape, w_type},
      bias: bias,
      has_bias: has_bias
    }
  end

  # `rows`: batch, or num_seqs with packed sequences.
  defp conv_initial_states(op, ops, s, rows) do
    meaning = if rows == s.batch, do: "(batch, dim, width - 1)", else: "(num_seqs, dim, width - 1)"

    optional(ops, :initial_states, fn ->
      expect!(op, ops, :initial_states, "initial_states", {rows, s.dim, s.width - 1}, [s.t], meaning)
    end)
  end

  # Packed sequences: {[cu_seqlens entry], num_seqs}, or {[], batch} without.
  defp conv_cu_seqlens(op, ops, s) do
    case Map.fetch(ops, :cu_seqlens) do
      :error ->
        {[], s.batch}

      {:ok, {shape, _}} ->
        unless tuple_size(shape) == 1 and elem(shape, 0) >= 1 do
          raise ArgumentError, "#{op}: operand `cu_seqlens` must have shape (num_seqs + 1), got #{fmt(shape)}"
        end

        unless s.batch == 1 do
          raise ArgumentError,
                "#{op}: operand `cu_seqlens` packs sequences along seqlen of one batch row: x's batch must be 1, got #{s.batch}"
        end

        entry = expect!(op, ops, :cu_seqlens, "cu_seqlens", shape, [{:s, 32}], "(num_seqs + 1)")
        {[entry], elem(shape, 0) - 1}
    end
  end

  defp conv_state!(op, ops, key, name, s, has_ix) do
    {shape, _} = desc(ops, key)

    slots =
      if has_ix do
        rank!(op, name, shape, 3, "(slots, dim, width - 1)")
        elem(shape, 0)
      else
        s.batch
      end

    expect!(op, ops, key, name, {slots, s.dim, s.width - 1}, [s.t], "(slots or batch, dim, width - 1)")
  end

  @doc """
  `xla_ssm_mamba_decode_step` (docs/decode.md): the fused conv update + SiLU + state update.

  Operands: `:x` `(batch, dim)` T, `:conv_state`, `:conv_weight`, `:ssm_state`, `:dt`, `:a`, `:b`,
  `:c`, optional `:conv_bias`, `:d`, `:z`, `:dt_bias`, `:state_batch_indices` (one index per row
  for both states). Options: `:dt_softplus` (false). Results: `out`, `conv_state`, `ssm_state`.
  """
  @spec mamba_decode_step(map | keyword, keyword) :: Call.t()
  def mamba_decode_step(operands, opts \\ []) do
    op = "mamba_decode_step"
    opts = validate_opts!(op, opts, dt_softplus: false)
    bool!(op, :dt_softplus, opts[:dt_softplus])

    ops =
      operands!(
        op,
        operands,
        [:x, :conv_state, :conv_weight, :ssm_state, :dt, :a, :b, :c],
        [:conv_bias, :d, :z, :dt_bias, :state_batch_indices]
      )

    u = check_update_inputs!(op, ops, :ssm_state, "ssm_state")
    conv_ops = Map.put(ops, :weight, ops.conv_weight)
    conv_ops = if Map.has_key?(ops, :conv_bias), do: Map.put(conv_ops, :bias, ops.conv_bias), else: conv_ops
    names = %{weight: "conv_weight", bias: "conv_bias"}
    c = check_conv_inputs!(op, conv_ops, [silu: true, layout: "bdl"], [2], names)
    # The conv state has the state update's slots (one index per row for both states).
    {_, {slots, _, _}, _} = u.state

    conv_state =
      expect!(
        op,
        ops,
        :conv_state,
        "conv_state",
        {slots, u.dim, c.width - 1},
        [u.t],
        "(slots or batch, dim, width - 1)"
      )

    [x, dt, a, b, cc] = u.operands
    operands = [x, conv_state, c.weight, u.state, dt, a, b, cc] ++ c.bias ++ u.optional

    attrs = [
      {"dt_softplus", Attr.bool(opts[:dt_softplus])},
      {"has_conv_bias", Attr.bool(c.has_bias)},
      {"has_d", Attr.bool(u.present.d)},
      {"has_z", Attr.bool(u.present.z)},
      {"has_dt_bias", Attr.bool(u.present.dt_bias)},
      {"has_state_batch_indices", Attr.bool(u.present.state_batch_indices)}
    ]

    {_, conv_shape, _} = conv_state
    {_, ssm_shape, ssm_type} = u.state
    results = [{"out", {u.batch, u.dim}, u.t}, {"conv_state", conv_shape, u.t}, {"ssm_state", ssm_shape, ssm_type}]
    build("xla_ssm_mamba_decode_step", operands, results, attrs, 0, false)
  end

  ## ---------------------------------------------------------------------------- helpers

  @doc """
  Normalizes a type to Nx's tuple form; raises for a type no target takes.

      iex> XlaSsm.Spec.normalize_type(:bf16)
      {:bf, 16}
  """
  @spec normalize_type(term) :: {atom, pos_integer}
  def normalize_type(type) do
    case type do
      {:f, 32} -> {:f, 32}
      {:bf, 16} -> {:bf, 16}
      {:f, 16} -> {:f, 16}
      {:s, 32} -> {:s, 32}
      {:u, 8} -> {:u, 8}
      :f32 -> {:f, 32}
      :bf16 -> {:bf, 16}
      :f16 -> {:f, 16}
      :s32 -> {:s, 32}
      :u8 -> {:u, 8}
      other -> raise ArgumentError, "unsupported type #{inspect(other)} (f32, bf16, f16, s32 or u8)"
    end
  end

  @doc "A type's short name, as the docs and the fixture write it (`{:bf, 16}` -> `\"bf16\"`)."
  @spec type_name({atom, pos_integer}) :: String.t()
  def type_name({kind, bits}), do: "#{kind}#{bits}"

  defp build(target, operands, results, attrs, workspace_bytes, with_workspace) do
    results =
      if with_workspace and workspace_bytes > 0,
        do: results ++ [{"workspace", {workspace_bytes}, {:u, 8}}],
        else: results

    %Call{target: target, operands: operands, results: results, attributes: attrs, workspace_bytes: workspace_bytes}
  end

  defp validate_opts!(op, opts, defaults) do
    unless Keyword.keyword?(opts) do
      raise ArgumentError, "#{op}: options must be a keyword list, got #{inspect(opts)}"
    end

    case Keyword.split(opts, Keyword.keys(defaults)) do
      {_, []} ->
        opts = Keyword.merge(defaults, opts)
        if Keyword.has_key?(opts, :workspace), do: bool!(op, :workspace, opts[:workspace])
        # One spelling of the layout from here on: the attribute's string.
        if Keyword.has_key?(opts, :layout), do: Keyword.update!(opts, :layout, &layout!(op, &1)), else: opts

      {_, unknown} ->
        raise ArgumentError,
              "#{op}: unknown options #{inspect(Keyword.keys(unknown))} (known: #{inspect(Keyword.keys(defaults))})"
    end
  end

  # The operands as a map of key => {shape, type} with normalized types; nil values are absent.
  defp operands!(op, operands, required, optional) do
    map =
      cond do
        is_map(operands) and not is_struct(operands) -> operands
        is_list(operands) and Keyword.keyword?(operands) -> Map.new(operands)
        true -> raise ArgumentError, "#{op}: operands must be a map or keyword list, got #{inspect(operands)}"
      end

    map = map |> Enum.reject(fn {_, v} -> is_nil(v) end) |> Map.new()

    case Map.keys(map) -- (required ++ optional) do
      [] ->
        :ok

      unknown ->
        raise ArgumentError,
              "#{op}: unknown operands #{inspect(Enum.sort(unknown))} (known: #{inspect(required ++ optional)})"
    end

    case required -- Map.keys(map) do
      [] -> :ok
      missing -> raise ArgumentError, "#{op}: missing operands #{inspect(missing)}"
    end

    Map.new(map, fn {key, value} -> {key, describe!(op, key, value)} end)
  end

  defp describe!(op, key, value) do
    {shape, type} =
      case value do
        {shape, type} ->
          {shape, type}

        %{shape: shape, type: type} ->
          {shape, type}

        other ->
          raise ArgumentError,
                "#{op}: operand #{inspect(key)} must be {shape, type} or have :shape and :type, got #{inspect(other)}"
      end

    unless is_tuple(shape) and Enum.all?(Tuple.to_list(shape), &(is_integer(&1) and &1 >= 0)) do
      raise ArgumentError,
            "#{op}: operand #{inspect(key)}: shape must be a tuple of non-negative integers, got #{inspect(shape)}"
    end

    type =
      try do
        normalize_type(type)
      rescue
        e in ArgumentError -> reraise ArgumentError, "#{op}: operand #{inspect(key)}: #{e.message}", __STACKTRACE__
      end

    {shape, type}
  end

  defp desc(ops, key), do: Map.fetch!(ops, key)

  # {[entry], true} when the optional operand is present (checked by `check`), else {[], false}.
  defp optional(ops, key, check) do
    if Map.has_key?(ops, key), do: {[check.()], true}, else: {[], false}
  end

  defp present_names(present, names) do
    # present is a map with keys in operand order; names follow that order.
    present
    |> present_in_order()
    |> Enum.zip(names)
    |> Enum.filter(fn {flag, _} -> flag end)
    |> Enum.map(fn {_, name} -> name end)
  end

  defp present_in_order(%{d: d, z: z, delta_bias: b, initial_state: h}), do: [d, z, b, h]
  defp present_in_order(%{d: d, z: z, dt_bias: b, initial_states: h}), do: [d, z, b, h]

  defp expect!(op, ops, key, name, shape, types, meaning) do
    {got_shape, got_type} = desc(ops, key)

    unless got_shape == shape do
      raise ArgumentError, "#{op}: operand `#{name}` must have shape #{fmt(shape)} #{meaning}, got #{fmt(got_shape)}"
    end

    type!(op, name, got_type, types)
    {name, shape, got_type}
  end

  defp type!(op, name, type, allowed) do
    unless type in allowed do
      names = Enum.map_join(allowed, " or ", &type_name/1)
      raise ArgumentError, "#{op}: operand `#{name}` must be #{names}, got #{type_name(type)}"
    end
  end

  defp rank!(op, name, shape, rank, meaning) do
    unless tuple_size(shape) == rank do
      raise ArgumentError, "#{op}: operand `#{name}` must have rank #{rank} #{meaning}, got shape #{fmt(shape)}"
    end
  end

  defp layout!(_op, layout) when layout in ["bdl", "bld"], do: layout
  defp layout!(op, layout) when layout in [:bdl, :bld], do: layout!(op, Atom.to_string(layout))

  defp layout!(op, other),
    do: raise(ArgumentError, ~s(#{op}: option :layout must be "bdl" or "bld", got #{inspect(other)}))

  defp bool!(_op, _name, value) when is_boolean(value), do: value

  defp bool!(op, name, value),
    do: raise(ArgumentError, "#{op}: option #{inspect(name)} must be a boolean, got #{inspect(value)}")

  defp fmt(shape), do: inspect(shape)
end
