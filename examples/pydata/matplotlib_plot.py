# A scatter plot with a fitted line: plt.show() saves it as plot-<cell>-001.png in the session
# directory, which the cell's files list as image/png.
import matplotlib.pyplot as plt
import numpy as np
import pandas as pd

mtcars = pd.read_csv("mtcars.csv")
slope, intercept = np.polyfit(mtcars.wt, mtcars.mpg, 1)
fig, ax = plt.subplots(figsize=(6, 4))
ax.scatter(mtcars.wt, mtcars.mpg)
xs = np.linspace(mtcars.wt.min(), mtcars.wt.max(), 50)
ax.plot(xs, intercept + slope * xs, color="red")
ax.set_xlabel("weight (1000 lbs)")
ax.set_ylabel("mpg")
ax.set_title("mpg ~ wt")
plt.show()
print(f"slope {slope:.4f}")
