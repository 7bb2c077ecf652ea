import pytest

from tests.signals.harness import Agent


@pytest.fixture
def make_agent(tmp_path):
    agents = []

    def make(**config):
        a = Agent(tmp_path / f"run{len(agents)}", **config)
        agents.append(a)
        return a

    yield make
    for a in agents:
        a.close()
