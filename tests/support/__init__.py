"""What the tests share: factories, fakes of the engine and the router, deployments
and the chaos suite's load, one module a concern."""
