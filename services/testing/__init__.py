"""What SplitMQ ships for testing code written against it: `StrategyContract` (a pytest base
class) and `check_strategy` run the strategy contract on a plugin's algorithm from the plugin's
own repository (docs/algorithms.md, "Write your own algorithm")."""

from services.testing.strategy_contract import StrategyContract, check_strategy

__all__ = ["StrategyContract", "check_strategy"]
