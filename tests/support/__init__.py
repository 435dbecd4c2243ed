"""Helpers shared by the tests (servers, peers, processes, SGLang's import); imported as
`tests.support.<module>`."""
