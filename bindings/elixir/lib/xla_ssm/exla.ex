# EXLA lowers every XlaSsm.Block tag to the library's custom call on the host and CUDA clients
# (the library registers its handlers for "Host" and "CUDA" when loaded, see XlaSsm.load/0); on
# any other platform (ROCm, TPU, an external PJRT plugin, whose XLA has none of our handlers) it
# compiles the block's default, XlaSsm.Reference. Compiled only where EXLA is (an optional dep).
if Code.ensure_loaded?(EXLA.CustomCall) do
  defimpl EXLA.CustomCall,
    for: [
      XlaSsm.Block.SelectiveScanFwd,
      XlaSsm.Block.SelectiveScanBwd,
      XlaSsm.Block.SsdFwd,
      XlaSsm.Block.SsdBwd,
      XlaSsm.Block.SelectiveStateUpdate,
      XlaSsm.Block.CausalConv1dFwd,
      XlaSsm.Block.CausalConv1dBwd,
      XlaSsm.Block.CausalConv1dUpdate,
      XlaSsm.Block.MambaDecodeStep
    ] do
    def call(tag, out, args, %{platform: platform}) when platform in [:host, :cuda] do
      call = XlaSsm.Block.spec(tag, args)
      # The block's output types come from the fallback; they must be the handler's results.
      :ok = XlaSsm.Block.check_output!(call, out)
      {:ok, %EXLA.CustomCall.Spec{call_target_name: call.target, attributes: call.attributes}}
    end

    def call(_tag, _out, _args, _client), do: :skip
  end
end
