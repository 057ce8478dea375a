// The data-parallel router's policies (driver/server/router.h), driven as ReplicaSet drives it:
// route, then count the request as outstanding on the replica it went to.
#include "driver/server/router.h"

#include <gtest/gtest.h>

#include <vector>

namespace tessera::server {
namespace {

constexpr size_t kBlock = 16;

std::vector<int32_t> prompt(int32_t prefix, size_t prefix_tokens, int32_t tail,
                            size_t tail_tokens) {
  std::vector<int32_t> p;
  for (size_t i = 0; i < prefix_tokens; ++i) p.push_back(prefix * 1000 + static_cast<int32_t>(i));
  for (size_t i = 0; i < tail_tokens; ++i) p.push_back(tail * 1000 + static_cast<int32_t>(i) + 500);
  return p;
}

// Routes and books the request on the chosen replica, as ReplicaSet::add does.
size_t route(Router& r, std::vector<ReplicaLoad>& load, const std::vector<int32_t>& p) {
  auto d = r.route(p, load);
  EXPECT_TRUE(d.has_value());
  if (!d) return 0;
  ++load[d->replica].outstanding;
  load[d->replica].waiting_prompt_tokens += p.size();
  return d->replica;
}

TEST(RouterTest, PoliciesParseAndNameThemselves) {
  for (const char* name : {"round_robin", "least_load", "prefix"}) {
    auto p = parse_router_policy(name);
    ASSERT_TRUE(p.has_value()) << name;
    EXPECT_STREQ(router_policy_name(*p), name);
  }
  auto bad = parse_router_policy("random");
  ASSERT_FALSE(bad.has_value());
  EXPECT_NE(bad.status().message().find("--router"), std::string::npos);
  EXPECT_NE(bad.status().message().find("least_load"), std::string::npos);
}

TEST(RouterTest, RoundRobinTakesTurnsAndSkipsUnroutable) {
  Router r(RouterPolicy::kRoundRobin, 3, kBlock, 100);
  std::vector<ReplicaLoad> load(3);
  std::vector<size_t> got;
  for (int i = 0; i < 6; ++i) got.push_back(route(r, load, prompt(i, 32, i, 4)));
  EXPECT_EQ(got, (std::vector<size_t>{0, 1, 2, 0, 1, 2}));
  load[1].routable = false;
  for (int i = 0; i < 4; ++i) EXPECT_NE(route(r, load, prompt(i, 32, i, 4)), 1u);
  for (auto& l : load) l.routable = false;
  EXPECT_FALSE(r.route(prompt(1, 32, 1, 4), load).has_value());
}

TEST(RouterTest, AnIdleStartBurstIsSpreadEvenly) {
  for (RouterPolicy policy : {RouterPolicy::kLeastLoad, RouterPolicy::kPrefix}) {
    Router r(policy, 2, kBlock, 1000);
    std::vector<ReplicaLoad> load(2);
    std::vector<int> count(2, 0);
    for (int i = 0; i < 40; ++i) ++count[route(r, load, prompt(i, 64, i, 8))];
    EXPECT_EQ(count[0], 20) << router_policy_name(policy);
    EXPECT_EQ(count[1], 20) << router_policy_name(policy);
  }
}

TEST(RouterTest, LeastLoadWeighsWaitingPromptTokens) {
  Router r(RouterPolicy::kLeastLoad, 2, kBlock, 100);
  std::vector<ReplicaLoad> load(2);
  load[0].outstanding = 1;
  load[0].waiting_prompt_tokens = 8192;  // one long prompt waiting: worth 16 short requests
  load[1].outstanding = 4;
  EXPECT_EQ(r.route(prompt(1, 16, 1, 4), load)->replica, 1u);
  load[1].outstanding = 20;
  EXPECT_EQ(r.route(prompt(1, 16, 1, 4), load)->replica, 0u);
}

TEST(RouterTest, RepeatsOfAPrefixGoWhereItIsCached) {
  Router r(RouterPolicy::kPrefix, 4, kBlock, 10000);
  std::vector<ReplicaLoad> load(4);
  // 8 system prompts of 160 tokens, each followed by 6 users' questions, interleaved.
  std::vector<size_t> home(8, 99);
  size_t matched_repeats = 0;
  for (int user = 0; user < 6; ++user) {
    for (int sys = 0; sys < 8; ++sys) {
      const auto p = prompt(sys, 160, sys * 10 + user, 20);
      auto d = r.route(p, load);
      ASSERT_TRUE(d.has_value());
      ++load[d->replica].outstanding;
      if (user == 0) {
        home[static_cast<size_t>(sys)] = d->replica;
        EXPECT_EQ(d->matched_tokens, 0u);
      } else {
        EXPECT_EQ(d->replica, home[static_cast<size_t>(sys)]) << "system prompt " << sys;
        matched_repeats += d->matched_tokens == 160;
      }
    }
  }
  EXPECT_EQ(matched_repeats, 5u * 8u);
  // The first requests of the system prompts were spread: two per replica.
  for (size_t i = 0; i < 4; ++i) EXPECT_EQ(std::count(home.begin(), home.end(), i), 2) << i;
  // Round robin ignores where the prefix is.
  Router rr(RouterPolicy::kRoundRobin, 4, kBlock, 10000);
  std::vector<ReplicaLoad> rl(4);
  std::vector<size_t> seen;
  for (int user = 0; user < 4; ++user) seen.push_back(route(rr, rl, prompt(0, 160, user, 20)));
  EXPECT_EQ(seen, (std::vector<size_t>{0, 1, 2, 3}));
}

TEST(RouterTest, LoadBeatsAffinityWhenTheHolderIsMuchBusier) {
  Router r(RouterPolicy::kPrefix, 2, kBlock, 1000);
  std::vector<ReplicaLoad> load(2);
  const auto p = prompt(7, 64, 1, 8);
  const size_t home = r.route(p, load)->replica;
  load[home].outstanding = 8;  // busier, within the thresholds: affinity holds
  EXPECT_EQ(r.route(p, load)->replica, home);
  load[home].outstanding = 40;  // 40 against 0: load wins
  auto d = r.route(p, load);
  EXPECT_NE(d->replica, home);
  EXPECT_EQ(d->matched_tokens, 0u);
  // The holder down: the other replica, which now has the prefix too.
  load[home].outstanding = 0;
  load[home].routable = false;
  EXPECT_NE(r.route(p, load)->replica, home);
}

TEST(RouterTest, MirrorsAreBoundedAndForgotten) {
  Router r(RouterPolicy::kPrefix, 2, kBlock, 8);  // 8 blocks per replica
  std::vector<ReplicaLoad> load(2);
  load[1].routable = false;
  const auto first = prompt(1, 64, 1, 0);  // 4 blocks
  r.route(first, load);
  r.route(prompt(2, 64, 2, 0), load);
  EXPECT_EQ(r.cached_blocks(0), 8u);
  r.route(prompt(3, 64, 3, 0), load);  // evicts the oldest, the first prompt's
  EXPECT_EQ(r.cached_blocks(0), 8u);
  EXPECT_EQ(r.route(first, load)->matched_tokens, 0u);
  r.forget(0);
  EXPECT_EQ(r.cached_blocks(0), 0u);
  // A prompt shorter than a block has nothing to match or remember.
  EXPECT_EQ(r.route(prompt(9, 5, 9, 0), load)->matched_tokens, 0u);
  EXPECT_EQ(r.cached_blocks(0), 0u);
}

}  // namespace
}  // namespace tessera::server
