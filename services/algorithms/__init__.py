"""Split-learning algorithms: pure tensor math (`math_*`) and one small strategy module each."""
