defmodule XlaSsm.MixProject do
  use Mix.Project

  @version "0.1.0"

  def project do
    [
      app: :xla_ssm,
      version: @version,
      elixir: "~> 1.15",
      elixirc_paths: elixirc_paths(Mix.env()),
      start_permanent: Mix.env() == :prod,
      deps: deps(),
      description: "Mamba state-space kernels (libxla_ssm XLA custom calls) for Nx and EXLA",
      package: [licenses: ["Apache-2.0"], files: ~w(lib priv mix.exs README.md)]
    ]
  end

  def application do
    [extra_applications: [:logger]]
  end

  defp elixirc_paths(:test), do: ["lib", "test/support"]
  defp elixirc_paths(_), do: ["lib"]

  defp deps do
    [
      # Nx.block/4 (the extension point every function here is built on) arrived in Nx 0.12.
      {:nx, "~> 0.12"},
      # EXLA.CustomCall arrived in EXLA 0.12; without EXLA the functions run their Nx fallbacks.
      {:exla, "~> 0.12", optional: true}
    ]
  end
end
