defmodule XlaSsm.Spec.Attr do
  @moduledoc """
  Custom-call attributes as MLIR attribute text, the form `EXLA.CustomCall.Spec.attributes` takes.

  EXLA places each `{name, text}` pair into the `backend_config` dictionary of a
  `stablehlo.custom_call` (api_version 4); MLIR parses the text and XLA turns each attribute into
  an FFI attribute. The encodings below are the ones the library's handlers decode
  (`src/xla/frame.rs`):

  | handler reads | text | XLA FFI attribute |
  |---|---|---|
  | `attr_bool` | `true` / `false` | PRED scalar |
  | `attr_i64` | `"42 : i64"` | S64 scalar |
  | `attr_f32` | `"0.5 : f32"`, `"0x7F800000 : f32"` (+inf) | F32 scalar |
  | `attr_str` | `"\\"bdl\\""` (quoted) | string |

  Floats go through `:erlang.float_to_binary(x, [:short])`, which always writes a decimal point
  or an exponent (MLIR rejects `0 : f32`) and the shortest digits that round-trip. Erlang has no
  infinities, so `:infinity` / `:neg_infinity` stand for them and are written as the f32 bit
  patterns in hex.
  """

  @i64_min -0x8000_0000_0000_0000
  @i64_max 0x7FFF_FFFF_FFFF_FFFF
  # The largest finite f32; MLIR refuses a literal that overflows its type.
  @f32_max 3.4028234663852886e38

  @doc """
  A bool attribute (PRED scalar).

      iex> XlaSsm.Spec.Attr.bool(true)
      "true"
  """
  @spec bool(boolean) :: String.t()
  def bool(true), do: "true"
  def bool(false), do: "false"
  def bool(other), do: raise(ArgumentError, "expected a boolean, got #{inspect(other)}")

  @doc """
  A signed 64-bit integer attribute.

      iex> XlaSsm.Spec.Attr.i64(32)
      "32 : i64"
  """
  @spec i64(integer) :: String.t()
  def i64(n) when is_integer(n) and n >= @i64_min and n <= @i64_max, do: "#{n} : i64"
  def i64(other), do: raise(ArgumentError, "expected a 64-bit integer, got #{inspect(other)}")

  @doc """
  An f32 attribute from a number, `:infinity` or `:neg_infinity`.

      iex> XlaSsm.Spec.Attr.f32(0)
      "0.0 : f32"
      iex> XlaSsm.Spec.Attr.f32(:infinity)
      "0x7F800000 : f32"
  """
  @spec f32(number | :infinity | :neg_infinity) :: String.t()
  def f32(:infinity), do: "0x7F800000 : f32"
  def f32(:neg_infinity), do: "0xFF800000 : f32"

  def f32(x) when is_number(x) do
    x = x * 1.0

    if abs(x) > @f32_max do
      raise ArgumentError, "#{x} does not fit an f32 (use :infinity or :neg_infinity for infinities)"
    end

    :erlang.float_to_binary(x, [:short]) <> " : f32"
  end

  def f32(other),
    do: raise(ArgumentError, "expected a number, :infinity or :neg_infinity, got #{inspect(other)}")

  @doc """
  A string attribute: quoted, with `"` and `\\` escaped and other bytes outside printable ASCII
  written as MLIR's `\\XX` hex escapes.

      iex> XlaSsm.Spec.Attr.string("bdl")
      ~s("bdl")
  """
  @spec string(String.t()) :: String.t()
  def string(s) when is_binary(s) do
    escaped = for <<byte <- s>>, into: "", do: escape(byte)
    ~s("#{escaped}")
  end

  def string(other), do: raise(ArgumentError, "expected a string, got #{inspect(other)}")

  defp escape(?"), do: ~S(\")
  defp escape(?\\), do: ~S(\\)
  defp escape(byte) when byte >= 0x20 and byte < 0x7F, do: <<byte>>

  defp escape(byte) do
    hex = byte |> Integer.to_string(16) |> String.pad_leading(2, "0")
    "\\" <> hex
  end
end
