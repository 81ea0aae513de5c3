"""Code the guides show whole and the tests run: `engine`, the loop of docs/engine.md."""
