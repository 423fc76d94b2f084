import uvloop


def pytest_asyncio_loop_factories(config, item):
    """Run the transfer tests on uvloop, like the roles do."""
    return {"uvloop": uvloop.new_event_loop}
