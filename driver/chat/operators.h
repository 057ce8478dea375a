// Python's operators on Values, as Jinja evaluates them: + - * / // % ** ~, unary - and +,
// and `in`.
#pragma once

#include "driver/chat/ast.h"
#include "driver/chat/value.h"

namespace tessera::chat::jinja {

// a <op> b for the arithmetic operators and ~ (kAdd ... kPow, kConcat). Throws RenderError
// with Python's message for unsupported operand types, division by zero, and for integer
// overflow (Python's integers have no bound; ours are 64-bit).
Value binary_op(Op op, const Value& a, const Value& b);
// -v or +v.
Value unary_op(Op op, const Value& v);
// Python's `item in container`.
bool contains(const Value& container, const Value& item);

}  // namespace tessera::chat::jinja
