"""CallRouter without Ray: each method goes to its group, and a replica of a trained model gets
the home's weights before a call that would read older ones (and only then)."""

from types import SimpleNamespace

from workbench.deploy.routing import CallRouter


class Done:
    def __init__(self, value=None):
        self.value = value

    def get(self):
        return self.value


class FakeGroup:
    """Records the methods called on it, in order."""

    def __init__(self, role, log):
        self.role, self.log, self.world_size, self.config = role, log, 1, f"{role} config"
        self.hostset = SimpleNamespace(weight_links={})  # a process set: its roles' newest links
        self.pool = SimpleNamespace(node_ids=["node"], shares_devices=lambda other: False)

    def __getattr__(self, method):
        if method.startswith("_"):
            raise AttributeError(method)
        return lambda *args, **kwargs: self.log.append((self.role, method, args)) or Done(f"{self.role}.{method}")


def test_calls_go_to_their_group_and_replicas_get_the_newest_weights_once():
    log = []
    home, replica = FakeGroup("critic", log), FakeGroup("critic_d1", log)
    critic = CallRouter("critic", home, {"compute_values": replica}, train_method="update_critic")
    assert critic.config == "critic config"  # everything else is the home's
    critic.compute_values("gen0").get()
    critic.compute_values("gen0 again")
    critic.update_critic("batch0")
    critic.compute_values("gen1")
    critic.load_checkpoint("path")
    critic.compute_values("gen2")
    calls = [(role, method) for role, method, _ in log if "channel" not in method]
    assert calls == [
        ("critic", "send_weights"),
        ("critic_d1", "receive_weights"),
        ("critic_d1", "compute_values"),
        ("critic_d1", "compute_values"),  # same version: nothing pushed
        ("critic", "update_critic"),
        ("critic", "send_weights"),
        ("critic_d1", "receive_weights"),
        ("critic_d1", "compute_values"),
        ("critic", "load_checkpoint"),  # new weights on the home: pushed again
        ("critic", "send_weights"),
        ("critic_d1", "receive_weights"),
        ("critic_d1", "compute_values"),
    ]
    assert [args for role, method, args in log if method == "receive_weights"] == [(0,), (1,), (2,)]
    assert sum(method == "open_weight_channel" for _, method, _ in log) == 1  # one link, kept
    replica.hostset = SimpleNamespace(weight_links={})  # the replica was re-created: a new link, and a push
    critic.compute_values("gen3")
    assert sum(method == "open_weight_channel" for _, method, _ in log) == 2
    assert log[-1][:2] == ("critic_d1", "compute_values") and log[-2][:2] == ("critic_d1", "receive_weights")


def test_a_frozen_models_replica_is_never_pushed():
    log = []
    reward = CallRouter("reward", FakeGroup("reward", log), {"compute_reward": FakeGroup("reward_d1", log)})
    reward.compute_reward("gen")
    assert [(role, method) for role, method, _ in log] == [("reward_d1", "compute_reward")]
