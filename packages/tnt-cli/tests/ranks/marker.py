"""Creates $TNT_TEST_DIR/ran.<rank>: proof that it was started."""
import os

open(os.path.join(os.environ["TNT_TEST_DIR"], f"ran.{os.environ['TNT_RANK']}"), "w").close()
