// How the driver library words an actor's death for a person.
#include "driver/client.h"

#include <gtest/gtest.h>

namespace tessera {
namespace {

ActorView dead_actor() {
  ActorView a;
  a.actor_id = "a-1f2e";
  a.node_id = "n-3f2a";
  a.gpus = {1};
  a.state = "dead";
  a.log_path = "/tmp/s/logs/actor-a-1f2e.log";
  return a;
}

TEST(DescribeDeathTest, SignalExitAndHang) {
  ActorView killed = dead_actor();
  killed.term_signal = 9;
  killed.death_reason = "killed by signal 9 (SIGKILL)";
  killed.last_log_line = "loading layer 3";
  EXPECT_EQ(describe_death(killed),
            "actor a-1f2e (GPU 1 on node n-3f2a) was killed by signal 9 (SIGKILL); its log: "
            "/tmp/s/logs/actor-a-1f2e.log");

  ActorView exited = dead_actor();
  exited.gpus = {};
  exited.exit_code = 3;
  exited.death_reason = "exited with code 3";
  exited.last_log_line = "E actor[7] cannot load model: no tensor model.norm.weight";
  EXPECT_EQ(describe_death(exited),
            "actor a-1f2e (CPU on node n-3f2a) exited with code 3 after: E actor[7] cannot load "
            "model: no tensor model.norm.weight; its log: /tmp/s/logs/actor-a-1f2e.log");

  ActorView hung = dead_actor();
  hung.gpus = {0, 1};
  hung.hung = true;
  hung.term_signal = 9;
  hung.death_reason =
      "was killed by its daemon after no heartbeat for 5.0 s (the process was stopped, or stuck "
      "in a step)";
  EXPECT_EQ(describe_death(hung),
            "actor a-1f2e (GPUs 0,1 on node n-3f2a) stopped answering: it was killed by its daemon "
            "after no heartbeat for 5.0 s (the process was stopped, or stuck in a step); its log: "
            "/tmp/s/logs/actor-a-1f2e.log");
}

}  // namespace
}  // namespace tessera
