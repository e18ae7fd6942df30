defmodule XlaSsm.FixtureTest do
  # The golden fixture that tests/suite/exla_frames.rs checks against the Rust library. Pure Elixir.
  use ExUnit.Case, async: true

  alias XlaSsm.Test.Fixture

  test "test/fixtures/exla_calls.txt is what XlaSsm.Spec builds today" do
    text = Fixture.render()

    if System.get_env("XLA_SSM_WRITE_FIXTURE") == "1" do
      File.write!(Fixture.path(), text)
      IO.puts("wrote #{Fixture.path()}")
    end

    committed = File.read!(Fixture.path())

    if committed != text do
      diff =
        Enum.zip(String.split(committed, "\n"), String.split(text, "\n"))
        |> Enum.with_index(1)
        |> Enum.find(fn {{a, b}, _} -> a != b end)

      flunk("""
      the fixture is out of date (rewrite it with XLA_SSM_WRITE_FIXTURE=1 and rerun tests/suite/exla_frames.rs);
      first difference: #{inspect(diff)}
      """)
    end
  end

  test "every target is in the fixture, each call's ids are unique" do
    calls = Fixture.calls()
    ids = Enum.map(calls, &elem(&1, 0))
    assert ids == Enum.uniq(ids)
    targets = calls |> Enum.map(fn {_, call} -> call.target end) |> Enum.uniq() |> Enum.sort()
    assert targets == XlaSsm.Spec.targets() |> Enum.map(&"xla_ssm_#{&1}") |> Enum.sort()
  end
end
