defmodule XlaSsm.Block do
  @moduledoc """
  The `Nx.block/4` tags of the library's targets, and what both the EXLA lowering and the
  fallback make of them.

  A tag holds everything static about a call: `operands`, the `XlaSsm.Spec` keys of the block's
  tensor arguments in order (which optional operands are present), and `opts`, the
  `XlaSsm.Spec` options. `spec/2` rebuilds the `XlaSsm.Spec.Call` from the tag and the argument
  shapes; `EXLA.CustomCall` (lib/xla_ssm/exla.ex) turns it into EXLA's custom-call spec and
  `fallback/2` runs `XlaSsm.Reference` instead.
  """

  alias XlaSsm.Spec

  @tags [
    {XlaSsm.Block.SelectiveScanFwd, :selective_scan_fwd},
    {XlaSsm.Block.SelectiveScanBwd, :selective_scan_bwd},
    {XlaSsm.Block.SsdFwd, :ssd_fwd},
    {XlaSsm.Block.SsdBwd, :ssd_bwd},
    {XlaSsm.Block.SelectiveStateUpdate, :selective_state_update},
    {XlaSsm.Block.CausalConv1dFwd, :causal_conv1d_fwd},
    {XlaSsm.Block.CausalConv1dBwd, :causal_conv1d_bwd},
    {XlaSsm.Block.CausalConv1dUpdate, :causal_conv1d_update},
    {XlaSsm.Block.MambaDecodeStep, :mamba_decode_step}
  ]

  @doc "Every tag module."
  def tags, do: Enum.map(@tags, &elem(&1, 0))

  @doc "The `XlaSsm.Spec` (and `XlaSsm.Reference`) function of a tag."
  def function(%module{}), do: function(module)

  for {module, function} <- @tags do
    def function(unquote(module)), do: unquote(function)
  end

  @doc "The custom call a tag stands for, given the block's arguments (tensors or templates)."
  @spec spec(struct, [Nx.Tensor.t()]) :: Spec.Call.t()
  def spec(tag, args) do
    apply(Spec, function(tag), [operands(tag, args), tag.opts])
  end

  @doc "The plain-Nx implementation of a tag (`XlaSsm.Reference`): the block's default."
  def fallback(tag, args) do
    apply(XlaSsm.Reference, function(tag), [operands(tag, args), tag.opts])
  end

  @doc """
  Runs a tag as an `Nx.block/4` on `args`; returns the results by name (the workspace left out).
  """
  @spec run(struct, [Nx.Tensor.t()]) :: %{String.t() => Nx.Tensor.t()}
  def run(tag, args) do
    # Inside defn Nx.block takes expressions only; an argument from outside the traced function
    # (boundaries a closure holds, say) becomes a constant of the expression.
    args =
      if Enum.any?(args, &match?(%Nx.Tensor{data: %Nx.Defn.Expr{}}, &1)),
        do: Enum.map(args, &Nx.Defn.Expr.tensor/1),
        else: args

    call = spec(tag, args)
    templates = Enum.map(call.results, fn {_, shape, type} -> Nx.template(shape, type) end)
    output = if length(templates) == 1, do: hd(templates), else: List.to_tuple(templates)
    result = Nx.block(tag, args, output, default_fun(length(args)))
    values = if is_tuple(result), do: Tuple.to_list(result), else: [result]

    call.results
    |> Enum.zip(values)
    |> Enum.reject(fn {{name, _, _}, _} -> name == "workspace" end)
    |> Map.new(fn {{name, _, _}, value} -> {name, value} end)
  end

  @doc """
  Checks that a block's output (as EXLA hands it over: a tensor or a tuple of them) is what the
  call returns, result for result; raises otherwise (the fallback and the spec disagree).
  """
  def check_output!(%Spec.Call{} = call, out) do
    leaves = if is_tuple(out), do: Tuple.to_list(out), else: [out]
    got = Enum.map(leaves, &{&1.shape, &1.type})
    want = Enum.map(call.results, fn {_, shape, type} -> {shape, type} end)

    unless got == want do
      raise ArgumentError,
            "#{call.target}: the block's output #{inspect(got)} is not the target's results #{inspect(want)}"
    end

    :ok
  end

  defp operands(%{operands: keys}, args) do
    unless length(keys) == length(args) do
      raise ArgumentError, "expected #{length(keys)} block arguments (#{inspect(keys)}), got #{length(args)}"
    end

    keys |> Enum.zip(args) |> Map.new()
  end

  # Nx.block/4 calls its default with the tag and then each argument: one arity per count.
  for n <- 1..16 do
    args = Macro.generate_arguments(n, __MODULE__)

    defp default_fun(unquote(n)) do
      fn tag, unquote_splicing(args) -> fallback(tag, unquote(args)) end
    end
  end
end

# The tags: one struct per target. `operands` are the XlaSsm.Spec keys of the block's arguments, in
# order; `opts` the XlaSsm.Spec options of the call.
defmodule XlaSsm.Block.SelectiveScanFwd do
  @moduledoc "`Nx.block/4` tag of `xla_ssm_selective_scan_fwd` (see `XlaSsm.Block`)."
  defstruct operands: [], opts: []
end

defmodule XlaSsm.Block.SelectiveScanBwd do
  @moduledoc "`Nx.block/4` tag of `xla_ssm_selective_scan_bwd` (see `XlaSsm.Block`)."
  defstruct operands: [], opts: []
end

defmodule XlaSsm.Block.SsdFwd do
  @moduledoc "`Nx.block/4` tag of `xla_ssm_ssd_fwd` (see `XlaSsm.Block`)."
  defstruct operands: [], opts: []
end

defmodule XlaSsm.Block.SsdBwd do
  @moduledoc "`Nx.block/4` tag of `xla_ssm_ssd_bwd` (see `XlaSsm.Block`)."
  defstruct operands: [], opts: []
end

defmodule XlaSsm.Block.SelectiveStateUpdate do
  @moduledoc "`Nx.block/4` tag of `xla_ssm_selective_state_update` (see `XlaSsm.Block`)."
  defstruct operands: [], opts: []
end

defmodule XlaSsm.Block.CausalConv1dFwd do
  @moduledoc "`Nx.block/4` tag of `xla_ssm_causal_conv1d_fwd` (see `XlaSsm.Block`)."
  defstruct operands: [], opts: []
end

defmodule XlaSsm.Block.CausalConv1dBwd do
  @moduledoc "`Nx.block/4` tag of `xla_ssm_causal_conv1d_bwd` (see `XlaSsm.Block`)."
  defstruct operands: [], opts: []
end

defmodule XlaSsm.Block.CausalConv1dUpdate do
  @moduledoc "`Nx.block/4` tag of `xla_ssm_causal_conv1d_update` (see `XlaSsm.Block`)."
  defstruct operands: [], opts: []
end

defmodule XlaSsm.Block.MambaDecodeStep do
  @moduledoc "`Nx.block/4` tag of `xla_ssm_mamba_decode_step` (see `XlaSsm.Block`)."
  defstruct operands: [], opts: []
end
