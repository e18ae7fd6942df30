# `mix test` (needs Nx): the pure tests plus test/nx_test.exs. Without Nx/Hex, run the pure ones
# alone with test/run_pure.sh.
ExUnit.start()
