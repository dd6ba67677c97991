# Mean fuel economy by number of cylinders, from a CSV of R's mtcars data set (uploaded as
# mtcars.csv); matches R's aggregate(mpg ~ cyl, data = mtcars, FUN = mean).
import pandas as pd

df = pd.read_csv("mtcars.csv")
print(df.shape)
summary = df.groupby("cyl").agg(n=("mpg", "size"), mpg=("mpg", "mean"), hp=("hp", "median"))
print(summary.round(5))
