// The syntax tree of a parsed template: expressions and statements, owned top-down.
#pragma once

#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "driver/chat/builtins.h"
#include "driver/chat/value.h"

namespace tessera::chat::jinja {

// ---- expressions -------------------------------------------------------------------------

struct Expr {
  enum class Kind {
    kLiteral,
    kName,
    kList,
    kDict,
    kAttr,
    kItem,
    kSlice,
    kCall,
    kFilter,
    kTest,
    kUnary,
    kBinary,
    kCompare,
    kCond,
  };
  explicit Expr(Kind k) : kind(k) {}
  virtual ~Expr() = default;
  Kind kind;
  size_t offset = 0;  // in the normalized source
};
using ExprPtr = std::unique_ptr<Expr>;

struct LiteralExpr : Expr {
  LiteralExpr() : Expr(Kind::kLiteral) {}
  Value value;
};
struct NameExpr : Expr {
  NameExpr() : Expr(Kind::kName) {}
  std::string name;
};
struct ListExpr : Expr {  // [a, b] or (a, b)
  ListExpr() : Expr(Kind::kList) {}
  std::vector<ExprPtr> items;
  bool tuple = false;
};
struct DictExpr : Expr {
  DictExpr() : Expr(Kind::kDict) {}
  std::vector<std::pair<ExprPtr, ExprPtr>> items;
};
struct AttrExpr : Expr {  // object.name
  AttrExpr() : Expr(Kind::kAttr) {}
  ExprPtr object;
  std::string name;
};
struct ItemExpr : Expr {  // object[index]
  ItemExpr() : Expr(Kind::kItem) {}
  ExprPtr object;
  ExprPtr index;
};
struct SliceExpr : Expr {  // object[start:stop:step], each optional
  SliceExpr() : Expr(Kind::kSlice) {}
  ExprPtr object, start, stop, step;
};
struct ArgExprs {
  std::vector<ExprPtr> positional;
  std::vector<std::pair<std::string, ExprPtr>> keyword;
};
struct CallExpr : Expr {
  CallExpr() : Expr(Kind::kCall) {}
  ExprPtr callee;
  ArgExprs args;
};
struct FilterExpr : Expr {  // input | name(args); input is null inside {% filter %}
  FilterExpr() : Expr(Kind::kFilter) {}
  ExprPtr input;
  std::string name;
  FilterFn fn = nullptr;  // null: a Jinja filter this renderer lacks
  ArgExprs args;
};
struct TestExpr : Expr {  // input is [not] name(args)
  TestExpr() : Expr(Kind::kTest) {}
  ExprPtr input;
  std::string name;
  TestFn fn = nullptr;  // null: a Jinja test this renderer lacks
  ArgExprs args;
  bool negated = false;
};
// clang-format off
enum class Op {
  kNot, kNeg, kPos,                                                   // unary
  kAdd, kSub, kMul, kDiv, kFloorDiv, kMod, kPow, kConcat, kAnd, kOr,  // binary
  kEq, kNe, kLt, kLe, kGt, kGe, kIn, kNotIn,                          // comparison
};
// clang-format on
struct UnaryExpr : Expr {
  UnaryExpr() : Expr(Kind::kUnary) {}
  Op op = Op::kNot;
  ExprPtr operand;
};
struct BinaryExpr : Expr {
  BinaryExpr() : Expr(Kind::kBinary) {}
  Op op = Op::kAdd;
  ExprPtr left, right;
};
struct CompareExpr : Expr {  // first op1 e1 op2 e2 ..., chained as in Python
  CompareExpr() : Expr(Kind::kCompare) {}
  ExprPtr first;
  std::vector<std::pair<Op, ExprPtr>> rest;
};
struct CondExpr : Expr {  // then if cond else otherwise (otherwise may be null)
  CondExpr() : Expr(Kind::kCond) {}
  ExprPtr cond, then, otherwise;
};

// ---- statements --------------------------------------------------------------------------

struct Stmt;
using StmtPtr = std::unique_ptr<Stmt>;
using Body = std::vector<StmtPtr>;

struct Stmt {
  enum class Kind {
    kText,
    kOutput,
    kIf,
    kFor,
    kSet,
    kSetBlock,
    kMacro,
    kBreak,
    kContinue,
    kFilterBlock,
    kWith,
    kBlock,
  };
  explicit Stmt(Kind k) : kind(k) {}
  virtual ~Stmt() = default;
  Kind kind;
  size_t offset = 0;
};

struct TextStmt : Stmt {
  TextStmt() : Stmt(Kind::kText) {}
  std::string text;
};
struct OutputStmt : Stmt {  // {{ expr }}
  OutputStmt() : Stmt(Kind::kOutput) {}
  ExprPtr expr;
};
struct IfStmt : Stmt {  // if / elif ... / else
  IfStmt() : Stmt(Kind::kIf) {}
  std::vector<std::pair<ExprPtr, Body>> branches;
  Body otherwise;
};
struct ForStmt : Stmt {  // for targets in iterable [if filter] ... [else ...]
  ForStmt() : Stmt(Kind::kFor) {}
  std::vector<std::string> targets;
  bool unpack = false;  // "for a, b in ..."
  ExprPtr iterable, filter;
  Body body, otherwise;
};
// An assignment target: a name, a namespace attribute (ns.attr) or names to unpack (a, b).
struct Target {
  std::vector<std::string> names;
  std::string attr;  // non-empty: names[0].attr
  bool unpack = false;
};
struct SetStmt : Stmt {  // set target = value
  SetStmt() : Stmt(Kind::kSet) {}
  Target target;
  ExprPtr value;
};
struct SetBlockStmt : Stmt {  // set target [| filters] ... endset
  SetBlockStmt() : Stmt(Kind::kSetBlock) {}
  Target target;
  std::vector<std::unique_ptr<FilterExpr>> filters;
  Body body;
};
struct MacroStmt : Stmt {
  MacroStmt() : Stmt(Kind::kMacro) {}
  std::string name;
  std::vector<std::pair<std::string, ExprPtr>> params;  // default may be null
  Body body;
};
struct BreakStmt : Stmt {
  BreakStmt() : Stmt(Kind::kBreak) {}
};
struct ContinueStmt : Stmt {
  ContinueStmt() : Stmt(Kind::kContinue) {}
};
struct FilterBlockStmt : Stmt {  // filter f | g ... endfilter
  FilterBlockStmt() : Stmt(Kind::kFilterBlock) {}
  std::vector<std::unique_ptr<FilterExpr>> filters;
  Body body;
};
struct WithStmt : Stmt {  // with a = x, b = y ... endwith
  WithStmt() : Stmt(Kind::kWith) {}
  std::vector<std::pair<std::string, ExprPtr>> assignments;
  Body body;
};
struct BlockStmt : Stmt {  // a body that only groups, e.g. {% generation %}
  BlockStmt() : Stmt(Kind::kBlock) {}
  Body body;
};

// A parsed template: immutable, shareable between threads.
struct Template {
  std::string source;  // normalized
  Body body;
};

}  // namespace tessera::chat::jinja
