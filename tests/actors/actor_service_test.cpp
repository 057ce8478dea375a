// The actor's RPC face in-process: hello, health, shutdown, version check.
#include "actors/actor_service.h"

#include <gtest/gtest.h>
#include <unistd.h>

#include <memory>

#include "protocol/rpc.h"

namespace tessera {
namespace {

struct Env {
  kj::AsyncIoContext io = kj::setupAsyncIo();
  kj::Own<rpc::RpcServer> server;
};

TEST(ActorServiceTest, ServesHealthAndShutsDownOnRequest) {
  auto env = std::make_unique<Env>();
  CudaProbe probe;
  probe.note = "no GPU in this test";
  ActorService service({"a-test", "n-test"}, probe);
  const std::string key = "actor-key-0123456789abcdef";
  auto server = rpc::RpcServer::listen(env->io, "127.0.0.1:0", service.endpoint(key), "actor");
  ASSERT_TRUE(server) << server.status().to_string();
  env->server = kj::mv(*server);
  std::string address = "127.0.0.1:" + std::to_string(env->server->port());

  // Only the key opens it: the cluster token or another actor's key do not.
  auto stranger =
      rpc::connect(env->io, address, "test", "some-cluster-token-0000").wait(env->io.waitScope);
  ASSERT_FALSE(stranger);
  EXPECT_EQ(stranger.status().code(), Code::kPermissionDenied);
  EXPECT_NE(stranger.status().message().find("wrong actor key"), std::string::npos)
      << stranger.status().message();
  EXPECT_NE(stranger.status().message().find("only the lease that spawned actor a-test"),
            std::string::npos)
      << stranger.status().message();

  auto conn = rpc::connect(env->io, address, "test", key).wait(env->io.waitScope);
  ASSERT_TRUE(conn) << conn.status().to_string();
  EXPECT_EQ((*conn)->role, proto::Role::ACTOR);
  EXPECT_EQ((*conn)->server_id, "a-test");
  auto health = (*conn)->actor.healthRequest().send().wait(env->io.waitScope);
  EXPECT_EQ(std::string(health.getHealth().getActorId().cStr()), "a-test");
  EXPECT_EQ(health.getHealth().getPid(), ::getpid());
  EXPECT_EQ(std::string(health.getHealth().getBackend().cStr()), "cpu");
  EXPECT_EQ(std::string(health.getHealth().getNote().cStr()), "no GPU in this test");

  auto done = service.on_shutdown();
  EXPECT_FALSE(done.poll(env->io.waitScope));
  (*conn)->actor.shutdownRequest().send().wait(env->io.waitScope);
  EXPECT_TRUE(done.poll(env->io.waitScope));

  auto old = rpc::connect(env->io, address, "old", key, 5 * kj::SECONDS, rpc::kProtocolVersion + 1)
                 .wait(env->io.waitScope);
  ASSERT_FALSE(old);
  EXPECT_NE(old.status().message().find("this actor speaks v"), std::string::npos)
      << old.status().message();
}

// A loadModel call dropped mid-load (its caller went away) still ends the load: the thread is
// joined on the actor's own loop, so the next loadModel is answered (here: the same bad model
// directory's error), not refused as "a model is loading already" forever.
TEST(ActorServiceTest, ACancelledLoadStillEnds) {
  auto env = std::make_unique<Env>();
  CudaProbe probe;
  ActorService service({"a-test", "n-test"}, probe);
  LoadSpec spec;  // resolved by hand: there is no model to resolve it against
  spec.engine.model = "/nonexistent/tessera-model";
  spec.engine.device = Device::kCpu;
  spec.engine.dtype = "float32";
  spec.engine.max_model_len = 64;
  spec.engine.max_num_batched_tokens = 64;
  spec.engine.pipeline_parallel_size = ParallelSize{1};
  spec.engine.quantization = QuantMethod::kNone;
  spec.engine.resolved = true;
  {
    auto dropped = service.load_model(spec);  // cancelled when it goes out of scope
  }
  Expected<ModelInfo> again = failed_precondition("not answered");
  for (int i = 0; i < 500; ++i) {  // the load fails fast; give its thread up to 5 s
    env->io.provider->getTimer().afterDelay(10 * kj::MILLISECONDS).wait(env->io.waitScope);
    again = service.load_model(spec).wait(env->io.waitScope);
    if (again.status().message().find("loading already") == std::string::npos) break;
  }
  ASSERT_FALSE(again);
  EXPECT_EQ(again.status().message().find("loading already"), std::string::npos)
      << again.status().message();
  EXPECT_NE(again.status().message().find("/nonexistent/tessera-model"), std::string::npos)
      << again.status().message();
}

TEST(ActorServiceTest, CudaProbeNeverFails) {
  CudaProbe probe = probe_cuda();
  if (!probe.available) {
    EXPECT_FALSE(probe.note.empty());  // it says why there is no GPU
  } else {
    EXPECT_FALSE(probe.devices.empty());
  }
}

}  // namespace
}  // namespace tessera
